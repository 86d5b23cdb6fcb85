"""The app three e2e modules share: two replicas of SmolLM2 (one core each) behind the prefix-aware router
(precise: the replicas report what their engines' KV caches hold), with LoRA adapters.
tests/e2e/test_routing_prefixes.py routes shared prompt prefixes and drains replicas;
tests/e2e/test_routing_precise.py evicts a prompt with long answers and follows the engines' caches;
tests/e2e/test_routing_adapters.py routes adapters, adds and removes them, and checks their answers
against vLLM's own. One app start for all three (tests/e2e/conftest.py stops it after the last test that uses
it); they sort next to each other by file name.

The engines run LoRA with one adapter in a batch and one in host memory (max_loras 1, max_cpu_loras 1),
so every adapter beyond the one a replica holds is a load there: what adapter-aware routing saves. The
adapters are made when the app starts (shunter.bench.lora_adapters): four seeded ones, one served only once
the admin API adds it, and one whose weights are garbage.

Keys come from key files (the keyed app, tests/e2e/keyed_app.py, shows the environment-variable way):
one for everything, one limited to one adapter, one for every adapter of the model (`smol:*`). One more
adapter is not in the config at all: the gateway finds it in the model's `adapter_dirs`.

Two adapters live in an object store: a real S3 endpoint on localhost (moto's server, in the test
process), whose address and credentials reach the replicas as a real cluster's nodes have them, in the
environment of the processes Ray starts (tests/e2e/conftest.py sets it before the cluster starts). One
holds legal's files (so it must answer as legal does), one is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shunter.auth import new_key
from shunter.config import EngineConfig
from shunter.cpu_dtype import engine_dtype
from shunter.lora_sources import local_copy
from tests.integration.local_app import local_app

from .live import LiveApp, wait_ready

APP = "routing-e2e"
MODEL = "smol"
ADAPTERS = ("legal", "medical", "finance", "travel")  # served from the start
ADDED = "poetry"  # made at the start, served only once a test adds it through the admin API
SCANNED = "support"  # not in the config: found in its adapter_dirs
BROKEN = "broken"  # its adapter_config.json is fine (so the config takes it), its weights are not
CLOUD, GHOST = "cloud", "ghost"  # in the object store: legal's files, and nothing
BUCKET = "shunter-e2e-adapters"
FULL, LEGAL_ONLY, TUNERS, ADMIN = new_key(), new_key(), new_key(), new_key()
ADAPTER_DIRS: dict[str, str] = {}  # name -> directory, filled when the app starts


# The adapters' reference answers: vLLM's own offline engine with each adapter as a LoRARequest, on the
# app's engine settings (the dtype its replicas resolve, eager, rank 8, one adapter at a time). It runs in a
# process of its own while the app starts (tests/e2e/test_routing_adapters.py reads its answers).
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 12
_REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
if __name__ == "__main__":
    base, adapters, tokens, question = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    llm = LLM(model=base, enable_lora=True, max_lora_rank=8, max_loras=1, max_model_len=1024, enforce_eager=True,
              max_num_seqs=4, dtype=sys.argv[5])
    params = SamplingParams(temperature=0, max_tokens=tokens)
    answers = {name: llm.chat(question, params, lora_request=LoRARequest(name, i + 1, path))[0].outputs[0].text
               for i, (name, path) in enumerate(adapters.items())}
    answers[""] = llm.chat(question, params)[0].outputs[0].text
    print("ANSWERS " + json.dumps(answers))
"""
_reference: list[subprocess.Popen] = []


def reference_answers() -> dict[str, str]:
    """vLLM's answers by adapter name ("" for the base model), once its process is done."""
    out, err = _reference[-1].communicate(timeout=600)
    line = next((ln for ln in out.splitlines() if ln.startswith("ANSWERS ")), None)
    assert line is not None, err[-3000:]
    return json.loads(line[len("ANSWERS "):])


def _start_reference(base: str, adapters: dict[str, str]) -> None:
    good = {name: adapters[name] for name in (*ADAPTERS, ADDED)}
    _reference.append(subprocess.Popen(
        [sys.executable, "-c", _REFERENCE, base, json.dumps(good), str(TOKENS), json.dumps(QUESTION),
         engine_dtype(EngineConfig().dtype, "cpu")],  # what the app's replicas (same node, same engine) run
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}))


def args(secrets: Path, adapters: dict[str, str]) -> dict[str, Any]:
    def key_file(name: str, key: str) -> str:
        path = secrets / name
        path.write_text(key + "\n")
        return str(path)

    return {
        "models": [{
            "name": MODEL, "source": "builtin:smollm2-135m-instruct", "replicas": 2, "cpu_cores_per_replica": 1,
            "engine": {"max_model_len": 2048, "max_num_seqs": 16, "cpu_kv_cache_gib": 1,
                       "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": 8,
                       # 32 blocks of 128 tokens (two longest prompts): a few long answers evict a
                       # prompt (tests/e2e/test_routing_precise.py)
                       "extra_engine_args": {"num_gpu_blocks_override": 32}},
            "adapters": [*({"name": n, "source": adapters[n]} for n in (*ADAPTERS, BROKEN)),
                         {"name": CLOUD, "source": f"s3://{BUCKET}/{CLOUD}"},
                         {"name": GHOST, "source": f"s3://{BUCKET}/{GHOST}"}],
            "adapter_dirs": [str(Path(adapters[SCANNED]).parent)],
        }],
        "auth": {
            "keys": [{"name": "full", "key_file": key_file("full", FULL)},
                     {"name": "legal-only", "key_file": key_file("legal", LEGAL_ONLY), "models": [f"{MODEL}:legal"]},
                     {"name": "tuners", "key_file": key_file("tuners", TUNERS), "models": [f"{MODEL}:*"]}],
            "admin_keys": [{"name": "ops", "key_file": key_file("admin", ADMIN)}],
        },
        # A batch whose lines name the adapters (tests/e2e/test_routing_adapters.py), run one line at a time:
        # each answer is compared with vLLM's own for its adapter, asked alone, and vLLM's CPU kernels are not
        # batch-invariant (in bfloat16, the finance adapter alone ends '...Theprint'; two or more of its
        # requests in one engine step end '...TheP', vLLM's offline engine as well as the app).
        "batch": {"state": str(secrets / "batch.sqlite3"), "files": str(secrets / "files"), "max_lines_in_flight": 1},
    }


def make_adapters(base: str, folder: Path) -> dict[str, str]:
    """Seeded adapters of the model at `base` (the same weights every run), by name, and the broken one."""
    from shunter.bench.lora_adapters import make_adapter

    made = {name: make_adapter(base, folder / name, seed=seed) for seed, name in enumerate((*ADAPTERS, ADDED), 1)}
    broken = make_adapter(base, folder / BROKEN, seed=99)
    (Path(broken) / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    (folder / "scanned").mkdir()
    scanned = make_adapter(base, folder / "scanned" / SCANNED, seed=7)
    return {**made, BROKEN: broken, SCANNED: scanned}


def object_store_env() -> dict[str, str]:
    """Start the S3 endpoint; the environment that points the nodes' S3 clients at it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()  # a daemon thread: it ends with the test session
    host, port = server.get_host_and_port()
    return {"AWS_ACCESS_KEY_ID": "e2e", "AWS_SECRET_ACCESS_KEY": "e2e", "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://{host}:{port}"}


def _upload(local: str, name: str) -> None:
    import pyarrow.fs as pafs

    store, _ = pafs.FileSystem.from_uri(f"s3://{BUCKET}?allow_bucket_creation=true")
    store.create_dir(BUCKET)
    pafs.copy_files(local, f"{BUCKET}/{name}", destination_filesystem=store)


@contextmanager
def routing_app(folder: Path) -> Iterator[LiveApp]:
    from shunter.catalog import resolve_source

    base = resolve_source("builtin:smollm2-135m-instruct", progress=False)
    (folder / "adapters").mkdir()
    (folder / "keys").mkdir()
    adapters = make_adapters(base, folder / "adapters")
    ADAPTER_DIRS.update(adapters)
    _upload(adapters["legal"], CLOUD)
    shutil.rmtree(local_copy(f"s3://{BUCKET}/{CLOUD}"), ignore_errors=True)  # a copy from an earlier run
    _start_reference(base, adapters)
    try:
        with local_app(args(folder / "keys", adapters), APP, keep_cluster=True) as app:
            wait_ready(app)
            yield LiveApp(base_url=app, api_key=FULL)
    finally:
        if _reference[-1].poll() is None:
            _reference[-1].kill()
