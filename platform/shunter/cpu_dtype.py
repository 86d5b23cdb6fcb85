"""The engine's dtype when the config says `auto`: on CPU, by the instruction set of the node the replica
runs on; on GPU, vLLM's own `auto` (the model's dtype).

bfloat16 is only fast on CPUs with bf16 instructions (AVX-512 BF16, AMX; Arm's BF16 extension). Elsewhere
(AVX2-only x86, such as many AMD EPYC) oneDNN emulates it and vLLM's own server runs about 3x slower
than in float32 (15.5 against 47.9 tok/s at 8 streams, TTFT p50 13.2 s against 2.2 s; see the design
doc). So `auto` on CPU is bfloat16 where the node has those instructions and float32 otherwise.

`resolve_dtype` decides from the flags it is given (pure, unit-tested); `engine_dtype` reads this node's
flags and says which dtype it chose and why. The replica calls it where it builds its engine's
arguments (`shunter.engine.EngineSpec.engine_args`), so the flags are those of the node the engine runs
on, and the bench's peers (vLLM's own server, Ray Serve LLM) get their dtype from the same call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import cache

log = logging.getLogger("ray.serve")

# /proc/cpuinfo flags (x86 `flags`, Arm `Features`) that make bf16 matrix work native.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "amx_tile", "bf16"})


def resolve_dtype(configured: str, accelerator: str, cpu_flags: Iterable[str],
                  quantization: str | None = None) -> tuple[str, str]:
    """The dtype to hand vLLM and why, for `engine.dtype` = `configured` on `accelerator` ("cpu" or
    "gpu") given the node's CPU flags. A quantized model's `auto` is vLLM's own: the method decides the
    activation dtype it runs in."""
    if accelerator != "cpu":
        if configured == "auto":
            return "auto", "auto: on GPU vLLM picks the model's own dtype"
        return configured, "engine.dtype in the config"
    if configured == "auto" and quantization:
        return "auto", f"auto: quantization {quantization} runs in the dtype vLLM picks for it"
    native = sorted(BF16_FLAGS & set(cpu_flags))
    if configured == "auto":
        if native:
            return "bfloat16", f"auto: this CPU has {'/'.join(native)}, bf16 runs natively"
        return "float32", "auto: this CPU has no AVX-512 BF16/AMX; bf16 would be emulated"
    if configured == "bfloat16" and not native:
        return configured, ("engine.dtype in the config; this CPU has no AVX-512 BF16/AMX, so bf16 is emulated "
                            "(about 3x slower than float32 here: set engine.dtype: auto)")
    return configured, "engine.dtype in the config"


@cache
def node_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """This node's CPU flags (the first processor's; empty where /proc/cpuinfo cannot be read)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, colon, value = line.partition(":")
                if colon and key.strip().lower() in ("flags", "features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def engine_dtype(configured: str, accelerator: str, quantization: str | None = None) -> str:
    """`resolve_dtype` with this node's flags; logs the choice and its reason."""
    dtype, why = resolve_dtype(configured, accelerator, node_cpu_flags() if accelerator == "cpu" else (),
                               quantization)
    log.info("engine dtype %s (%s)", dtype, why)
    return dtype
