"""engine.dtype `auto`: bfloat16 only where the node's CPU runs it natively, float32 elsewhere; vLLM's own
`auto` on GPU. Decided from the flags of the node the replica runs on, and said in its log."""

from __future__ import annotations

import logging

import pytest

from shunter.config import EngineConfig
from shunter.cpu_dtype import engine_dtype, node_cpu_flags, resolve_dtype
from shunter.engine import EngineSpec

AVX2_ONLY = {"fpu", "sse4_2", "avx", "avx2", "fma"}  # AMD EPYC (Zen 2/3), older Xeons
AVX512_NO_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512_vnni"}  # Skylake/Cascade Lake


@pytest.mark.parametrize("flags, dtype", [
    (AVX2_ONLY, "float32"),
    (AVX512_NO_BF16, "float32"),
    (AVX512_NO_BF16 | {"avx512_bf16"}, "bfloat16"),  # Cooper Lake, AMD Zen 4+
    (AVX512_NO_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}, "bfloat16"),  # Sapphire Rapids+
    ({"fp", "asimd", "bf16"}, "bfloat16"),  # Arm with its BF16 extension (Graviton3+)
    (set(), "float32"),  # flags unknown: the safe choice
])
def test_auto_on_cpu_goes_by_the_instruction_set(flags, dtype):
    chosen, why = resolve_dtype("auto", "cpu", flags)
    assert chosen == dtype and why.startswith("auto: ")
    if dtype == "float32":
        assert why == "auto: this CPU has no AVX-512 BF16/AMX; bf16 would be emulated"


def test_auto_on_gpu_and_quantized_stays_vllms_own_and_explicit_dtypes_win():
    assert resolve_dtype("auto", "gpu", AVX2_ONLY)[0] == "auto"
    assert resolve_dtype("auto", "cpu", AVX2_ONLY, quantization="awq")[0] == "auto"
    for dtype in ("bfloat16", "float16", "float32"):
        for accelerator in ("cpu", "gpu"):
            assert resolve_dtype(dtype, accelerator, AVX2_ONLY)[0] == dtype
    assert "emulated" in resolve_dtype("bfloat16", "cpu", AVX2_ONLY)[1], "an explicit slow choice is pointed out"
    assert "emulated" not in resolve_dtype("bfloat16", "cpu", AVX512_NO_BF16 | {"amx_bf16"})[1]


def test_auto_is_the_default_and_engine_args_carry_the_resolved_dtype(monkeypatch, caplog):
    assert EngineConfig().dtype == "auto"
    monkeypatch.setattr("shunter.cpu_dtype.node_cpu_flags", lambda: frozenset(AVX2_ONLY))
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        args = EngineSpec("m", "/m", "generate", EngineConfig(), "cpu").engine_args()
    assert args["dtype"] == "float32"
    assert "engine dtype float32 (auto: this CPU has no AVX-512 BF16/AMX; bf16 would be emulated)" in caplog.text
    assert EngineSpec("m", "/m", "generate", EngineConfig(), "gpu").engine_args()["dtype"] == "auto"
    monkeypatch.setattr("shunter.cpu_dtype.node_cpu_flags", lambda: frozenset(AVX2_ONLY | {"amx_bf16"}))
    assert EngineSpec("m", "/m", "generate", EngineConfig(), "cpu").engine_args()["dtype"] == "bfloat16"
    assert engine_dtype("float16", "cpu") == "float16"


def test_the_flags_are_read_from_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                   "processor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd bf16 i8mm\n")
    assert node_cpu_flags(str(x86)) == {"fpu", "avx2", "avx512_bf16"}
    assert "bf16" in node_cpu_flags(str(arm))
    assert node_cpu_flags(str(tmp_path / "missing")) == frozenset()
