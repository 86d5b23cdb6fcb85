"""The numbers of a model that decide how it may be split: attention heads, KV heads, layers.

Tensor parallelism splits attention heads across ranks, pipeline parallelism splits layers across
stages; a split the model cannot take fails deep inside the engine, minutes after start, on every
replica. Shunter reads the model's own `config.json` before anything starts and says what to change.

Where the config comes from, first found wins: a local model dir; a builtin model (its prepared dir, or
the facts below); an object-store model's copy on this node; the local Hugging Face cache (never the
network); the published configs of common hub models below. When none has it (a hub model not yet
downloaded, an object-store model not yet copied here), the check is left to the engine and the planner
says so.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shunter.catalog import BUILTIN_PREFIX, remote_models_cache
from shunter.object_store import is_remote, local_copy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    attention_heads: int
    kv_heads: int
    layers: int
    origin: str  # where the numbers were read, for messages

    @classmethod
    def from_config(cls, config: dict[str, Any], origin: str) -> ModelShape | None:
        """From a Hugging Face config.json; multimodal configs keep the language model in a sub-config."""
        for key in ("text_config", "llm_config", "language_config"):
            if isinstance(config.get(key), dict):
                config = {**config, **config[key]}
        heads = _first(config, "num_attention_heads", "n_head", "num_heads")
        layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
        if heads is None or layers is None:
            return None
        kv = _first(config, "num_key_value_heads", "multi_query_group_num", "n_head_kv") or heads
        return cls(int(heads), int(kv), int(layers), origin)


def _first(config: dict[str, Any], *keys: str) -> Any:
    return next((config[k] for k in keys if isinstance(config.get(k), int)), None)


# Published config.json values (facts, checked against the models' hub pages) for models people serve
# on GPU clusters, so example configs and clusters without a local copy can still be checked.
_PUBLISHED: dict[str, tuple[int, int, int]] = {
    "meta-llama/Llama-3.1-8B-Instruct": (32, 8, 32),
    "meta-llama/Llama-3.1-70B-Instruct": (64, 8, 80),
    "meta-llama/Llama-3.3-70B-Instruct": (64, 8, 80),
    "meta-llama/Llama-3.1-405B-Instruct": (128, 8, 126),
    "meta-llama/Llama-3.1-405B-Instruct-FP8": (128, 8, 126),
    "Qwen/Qwen2.5-7B-Instruct": (28, 4, 28),
    "Qwen/Qwen2.5-72B-Instruct": (64, 8, 80),
    "mistralai/Mistral-7B-Instruct-v0.3": (32, 8, 32),
    "HuggingFaceTB/SmolLM2-135M-Instruct": (9, 3, 30),
    # builtin models, by their builtin names
    "smollm2-135m-instruct": (9, 3, 30),
    "all-minilm-l6-v2": (12, 12, 6),
}


def model_shape(source: str, cache_dir: str | Path | None = None) -> ModelShape | None:
    """The shape of `source` (as in a model config), or None when no config can be found offline."""
    if source.startswith(BUILTIN_PREFIX):
        key = source[len(BUILTIN_PREFIX):]
        prepared = _prepared_builtin(key, cache_dir)
        if prepared is not None and (shape := _read_dir(prepared)):
            return shape
        return _published(key)
    if source.startswith("fake:"):  # the tests' fault-injecting engine: no weights, nothing to split
        return None
    if is_remote(source):  # read from this node's copy, if it has one: planning never reaches the store
        return _read_dir(local_copy(source.rstrip("/"), remote_models_cache(cache_dir)))
    local = Path(source).expanduser()
    if local.is_dir():
        return _read_dir(local)
    return _hf_cache(source) or _published(source)


def _read_dir(path: Path) -> ModelShape | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        return ModelShape.from_config(json.loads(config.read_text()), str(config))
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s: %s", config, exc)
        return None


def _prepared_builtin(key: str, cache_dir: str | Path | None) -> Path | None:
    from shunter.catalog import BUILTIN_MODELS, ModelSourceError, prepared_path

    if key not in BUILTIN_MODELS:
        return None
    try:
        return prepared_path(BUILTIN_MODELS[key], cache_dir)
    except ModelSourceError:
        return None


def _hf_cache(repo_id: str) -> ModelShape | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id is simply not in the cache
        return None
    return _read_dir(Path(found).parent) if isinstance(found, str) else None


def _published(key: str) -> ModelShape | None:
    numbers = _PUBLISHED.get(key)
    return ModelShape(*numbers, origin=f"published config of {key}") if numbers else None


def parallel_problems(where: str, shape: ModelShape, tensor_parallel: int, pipeline_parallel: int) -> list[str]:
    """What the engine would refuse about splitting this model, with the sizes that would work.

    vLLM's rules: TP divides the attention heads; KV heads are split when TP divides them and copied
    when they divide TP (grouped-query models with fewer KV heads than ranks); each stage needs a layer."""
    problems = []
    heads, kv = shape.attention_heads, shape.kv_heads
    working = [d for d in _divisors(heads) if kv % d == 0 or d % kv == 0]  # both rules hold
    if heads % tensor_parallel:
        problems.append(f"{where}: tensor_parallel_size {tensor_parallel} does not divide the model's {heads} "
                        f"attention heads ({shape.origin}); sizes that do: {working}")
    elif kv % tensor_parallel and tensor_parallel % kv:
        problems.append(f"{where}: tensor_parallel_size {tensor_parallel} neither divides nor is a multiple of "
                        f"the model's {kv} KV heads ({shape.origin}); sizes that work: {working}")
    if pipeline_parallel > shape.layers:
        problems.append(f"{where}: pipeline_parallel_size {pipeline_parallel} exceeds the model's "
                        f"{shape.layers} layers ({shape.origin}); every stage needs at least one layer")
    return problems


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
