"""`shunter models prepare FILE`: the builtin models a config uses, converted once into its cache dir.

Real conversion (SmolLM2's GGUF from its wheel into a bfloat16 safetensors dir) into a fresh cache dir:
a preparer killed mid-way leaves nothing a later one would load (and its temp dir is cleaned up), two
commands started together then convert once (the other waits on the lock and reuses the result), a
third finds it ready, and the result is byte for byte the checkpoint the e2e tests serve (`make models`
prepared it in the default cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shunter.catalog import BUILTIN_MODELS, _prepared_dir, default_cache_dir

SMOL = BUILTIN_MODELS["smollm2-135m-instruct"]
PREPARING = "preparing "  # the conversion's progress bar, on stderr, shown only by the process that converts


def _config(tmp_path: Path, cache: Path) -> Path:
    path = tmp_path / "prepare.yaml"
    path.write_text(yaml.safe_dump({"applications": [{
        "name": "shunter", "route_prefix": "/", "import_path": "shunter.deployments.app:build_app",
        "args": {"model_cache_dir": str(cache), "models": [
            {"name": "smol", "source": "builtin:smollm2-135m-instruct"},
            {"name": "minilm", "source": "builtin:all-minilm-l6-v2", "task": "embed"}]}}]}))
    return path


def _prepare(config: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shunter.cli", "models", "prepare", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out, err


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_killed_preparer_leaves_nothing_then_two_at_once_convert_once_and_a_third_finds_it_ready(tmp_path):
    cache = tmp_path / "cache"
    config = _config(tmp_path, cache)
    target = _prepared_dir(SMOL, cache)

    victim = _prepare(config)
    deadline = time.monotonic() + 120
    while not any(cache.glob(f".{SMOL.key}-*")):  # its temp dir: the conversion has begun
        assert time.monotonic() < deadline and victim.poll() is None, "the conversion never started"
        time.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)
    victim.communicate(timeout=30)
    assert not target.exists(), "a killed conversion left a dir behind under the final name"

    # The lock died with its holder: of two started together, one converts afresh and the other waits.
    first, second = _prepare(config), _prepare(config)
    (out1, err1), (out2, err2) = _finish(first), _finish(second)
    assert out1 == out2 and f"smol: builtin:smollm2-135m-instruct -> {target}" in out1
    assert "minilm: builtin:all-minilm-l6-v2 -> " in out1  # a packaged dir: used in place, nothing converted
    assert [PREPARING in err1, PREPARING in err2].count(True) == 1, (err1[-500:], err2[-500:])
    out3, err3 = _finish(_prepare(config))
    assert out3 == out1 and PREPARING not in err3

    assert (target / ".shunter-complete").exists()
    # No temp dir left, the killed preparer's included.
    assert sorted(p.name for p in cache.iterdir()) == [f".{SMOL.key}.lock", target.name]
    hf_config = json.loads((target / "config.json").read_text())
    dtype = hf_config.get("torch_dtype", hf_config.get("dtype"))
    assert "quantization_config" not in hf_config and dtype == "bfloat16", hf_config
    assert {"tokenizer.json", "model.safetensors"} <= {p.name for p in target.iterdir()}
    served = _prepared_dir(SMOL, default_cache_dir())
    if (served / ".shunter-complete").exists():  # the checkpoint every e2e test serves: same conversion
        assert _sha(target / "model.safetensors") == _sha(served / "model.safetensors")


def test_a_config_with_an_unknown_builtin_is_refused_before_anything_runs(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"applications": [{
        "name": "shunter", "route_prefix": "/", "import_path": "shunter.deployments.app:build_app",
        "args": {"models": [{"name": "x", "source": "builtin:no-such-model"}]}}]}))
    proc = subprocess.run([sys.executable, "-m", "shunter.cli", "models", "prepare", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no-such-model" in proc.stderr and "Traceback" not in proc.stderr


pytestmark = pytest.mark.timeout(420)
