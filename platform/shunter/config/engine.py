"""`engine:` of a model: the vLLM engine arguments Shunter owns, checked against the installed vLLM."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Literal

from pydantic import Field, field_validator

from shunter.config.base import StrictModel, closest

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
    "scheduling_policy": "engine.scheduling_policy",
    "enable_prefix_caching": "engine.enable_prefix_caching",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "quantization": "engine.quantization",
    "tensor_parallel_size": "engine.tensor_parallel_size",
    "pipeline_parallel_size": "engine.pipeline_parallel_size",
    "enforce_eager": "engine.enforce_eager",
    "seed": "engine.seed",
    "distributed_executor_backend": "(chosen by the platform from the accelerator)",
    "enable_lora": "engine.enable_lora",
    "max_loras": "engine.max_loras",
    "max_lora_rank": "engine.max_lora_rank",
    "max_cpu_loras": "engine.max_cpu_loras",
}


class EngineConfig(StrictModel):
    """vLLM engine settings of one model. Defaults suit a small model on a CPU laptop."""

    max_model_len: int | None = Field(
        default=2048,
        gt=0,
        description="Context length in tokens (prompt + completion). null = the model's own maximum.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto",
        description="Weight and activation dtype. auto: on CPU, by the instruction set of the node each replica "
        "runs on: bfloat16 where it has AVX-512 BF16 or AMX, float32 elsewhere (bf16 is emulated there, about 3x "
        "slower); on GPU, the model's own dtype (vLLM's auto). Each replica logs which dtype it chose and why.",
    )
    max_num_seqs: int = Field(default=64, gt=0, description="Most sequences the engine batches at once.")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs",
        description="How the engine orders the sequences it runs. priority: by each request's priority class "
        "(flow_control.classes; chat, completions and Responses requests), a more urgent arrival runs ahead "
        "of less urgent work already waiting in the engine and may preempt it; fcfs: in arrival order.",
    )
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
    cpu_nice: int = Field(
        default=19,
        ge=0,
        le=19,
        description="CPU only: the niceness of the engine's processes (and of the replica thread that starts "
        "it) once the engine is ready; it starts at the platform's. Ray runs every worker at 15; at 19 the "
        "gateway, HAProxy and Serve's controller, which share the cores with the engines, run first when they "
        "have work (a 400-stream burst on two one-core replicas: "
        "429s within 0.69-1.15 s p99 across runs, against 1.13-1.64 s without; the same throughput). Only "
        "ever raised: below the replica's own niceness, it keeps that.",
    )
    process_start: Literal["auto", "fork-server", "spawn"] = Field(
        default="auto",
        description="How a replica's processes start: its own (a Ray worker) and its engine's (vLLM's engine "
        "core and workers). fork-server: forked from the node's server that imported vLLM and torch once "
        "(shunter.engine_forkserver; the replica through its runtime_env's py_executable, shunter.worker_fork), "
        "so a replica pays no imports; spawn: as Ray and vLLM start them, each importing vLLM and torch anew "
        "(6-12 s each on 2 cores). auto: fork-server for a CPU engine on one node, spawn otherwise (GPU "
        "engines, whose fork path is not yet measured, and pipeline stages placed by Ray). Use spawn when the "
        "application's runtime_env brings its own interpreter or packages (pip, uv, conda, an image).",
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
    enable_lora: bool | None = Field(
        default=None,
        description="Run the engine with LoRA, so that adapters can be served (from `adapters`, or added "
        "through the admin API while it runs). null = on when the model lists `adapters`.",
    )
    max_loras: int = Field(
        default=4, ge=1, le=256,
        description="With `adapters`: LoRA adapters the engine runs at once (vLLM's max_loras); others wait in "
        "host memory, least recently used evicted first.",
    )
    max_lora_rank: int = Field(
        default=16, ge=1, le=512, description="With `adapters`: the largest LoRA rank an adapter may have.",
    )
    max_cpu_loras: int | None = Field(
        default=None, ge=1,
        description="With `adapters`: adapters kept loaded in host memory (vLLM's max_cpu_loras); null = "
        "max_loras. Past it, the least recently used is dropped and loaded again when next asked for.",
    )
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
        known = _vllm_engine_arg_names() if value else frozenset()
        if known:
            for key in value:
                if key not in known:
                    hint = closest(key, known)
                    fix = f"; did you mean {hint!r}?" if hint else ""
                    raise ValueError(f"{key!r} is not a vLLM engine argument{fix}")
        return value


@lru_cache(maxsize=1)
def _vllm_engine_arg_names() -> frozenset[str]:
    """AsyncEngineArgs field names, read from vLLM's source (never imported here: every model replica
    validates its config before its engine starts); empty when vLLM is not installed (the replica's
    start checks again)."""
    from shunter.vllm_compat import engine_arg_names

    return engine_arg_names()


@lru_cache(maxsize=1)
def _vllm_quantization_methods() -> frozenset[str]:
    from shunter.vllm_compat import quantization_methods

    return quantization_methods()
