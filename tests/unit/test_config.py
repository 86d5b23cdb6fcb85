"""Config validation: bad files fail before anything starts, with the field path and the fix."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from shunter.cli import main as cli_main
from shunter.config import ConfigError, ShunterConfig, parse_config

ROOT = Path(__file__).resolve().parents[2]


def _args(**model_overrides):
    model = {"name": "m", "source": "builtin:smollm2-135m-instruct", **model_overrides}
    return {"models": [model]}


def _error(args) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(args)
    return str(info.value)


def test_minimal_config_gets_working_defaults():
    cfg = parse_config(_args())
    model = cfg.models[0]
    assert model.task == "generate" and model.replicas == 1 and model.accelerator == "auto"
    assert model.engine.enable_prefix_caching is None  # auto: on for generate, off for embed
    assert model.engine.cpu_kv_cache_gib >= 1
    assert cfg.gateway.max_body_bytes == 1_048_576


def test_unknown_key_names_path_and_suggests_the_fix():
    msg = _error(_args(engine={"max_num_seq": 8}))
    assert "models[0].engine.max_num_seq: unknown key" in msg
    assert "did you mean 'max_num_seqs'?" in msg


def test_unknown_top_level_key_lists_allowed_keys():
    msg = _error({"models": _args()["models"], "zzz": 1})
    assert "zzz: unknown key" in msg and "models" in msg


def test_bad_value_names_path_and_value():
    msg = _error(_args(engine={"max_num_seqs": 0}))
    assert "models[0].engine.max_num_seqs" in msg and "greater than 0" in msg and "(got 0)" in msg


def test_bad_literal_lists_choices():
    msg = _error(_args(task="chat"))
    assert "models[0].task" in msg and "'generate'" in msg and "'embed'" in msg


def test_missing_source_is_reported():
    msg = _error({"models": [{"name": "m"}]})
    assert "models[0]: `source` is missing" in msg and "versions" in msg


def test_no_models_is_an_error():
    assert "models" in _error({"models": []})
    assert "mapping" in _error(None)


def test_unknown_builtin_lists_known_ones():
    msg = _error(_args(source="builtin:gpt-5"))
    assert "builtin:smollm2-135m-instruct" in msg and "builtin:all-minilm-l6-v2" in msg


def test_builtin_task_mismatch_says_which_task():
    msg = _error(_args(source="builtin:all-minilm-l6-v2"))
    assert "set task: embed" in msg


def test_duplicate_names_and_aliases_are_errors():
    args = {"models": [
        {"name": "a", "source": "builtin:smollm2-135m-instruct", "aliases": ["x"]},
        {"name": "b", "source": "builtin:all-minilm-l6-v2", "task": "embed", "aliases": ["x"]},
    ]}
    assert "'x' is used by both 'a' and 'b'" in _error(args)


def test_extra_engine_args_are_checked_against_vllm():
    cfg = parse_config(_args(engine={"extra_engine_args": {"max_num_batched_tokens": 4096}}))
    assert cfg.models[0].engine.extra_engine_args == {"max_num_batched_tokens": 4096}
    msg = _error(_args(engine={"extra_engine_args": {"max_num_batched_token": 1}}))
    assert "not a vLLM engine argument" in msg and "max_num_batched_tokens" in msg
    msg = _error(_args(engine={"extra_engine_args": {"tensor_parallel_size": 2}}))
    assert "engine.tensor_parallel_size instead" in msg


def test_quantization_is_checked_against_vllm():
    assert "unknown quantization" in _error(_args(engine={"quantization": "int3-magic"}))
    assert parse_config(_args(engine={"quantization": "fp8"})).models[0].engine.quantization == "fp8"


def test_fractions_and_counts_are_bounded():
    assert "gpu_memory_utilization" in _error(_args(engine={"gpu_memory_utilization": 1.5}))
    assert "cpu_cores_per_replica" in _error(_args(cpu_cores_per_replica=0))
    assert "replicas" in _error(_args(replicas=0))


def test_find_model_by_name_and_alias():
    cfg = parse_config(_args(aliases=["small"]))
    assert cfg.find_model("m") is cfg.find_model("small") is cfg.models[0]
    assert cfg.find_model("nope") is None


def test_every_field_is_documented():
    """The config is the product's interface: every field says what it is for."""
    from pydantic import BaseModel

    seen: set[type] = set()

    def walk(cls: type[BaseModel]) -> None:
        if cls in seen:
            return
        seen.add(cls)
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description"
            for arg in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    walk(arg)

    walk(ShunterConfig)
    assert len(seen) >= 4


def test_cli_config_check_accepts_the_shipped_local_config(capsys):
    assert cli_main(["config", "check", str(ROOT / "configs" / "local.yaml")]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "smollm2-135m-instruct" in out and "cpu_kv_cache_gib" in out


def test_cli_config_check_rejects_a_bad_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent("""
        applications:
          - name: x
            import_path: shunter.deployments.app:build_app
            args:
              models:
                - name: m
                  source: builtin:smollm2-135m-instruct
                  engine: {dtype: float8}
    """))
    with pytest.raises(SystemExit) as info:
        cli_main(["config", "check", str(bad)])
    assert "args" in str(info.value) and "models[0].engine.dtype" in str(info.value)


def test_cli_config_check_rejects_a_non_serve_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: []\n")
    with pytest.raises(SystemExit) as info:
        cli_main(["config", "check", str(bad)])
    assert "applications" in str(info.value)


def test_a_config_with_the_former_import_path_is_told_the_new_one(tmp_path):
    config = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    config["applications"][0]["import_path"] = "deployments.app:build_app"
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit, match="'deployments.app:build_app' is now 'shunter.deployments.app:build_app'"):
        cli_main(["config", "check", str(old)])


def test_shunter_serve_refuses_a_bad_file_or_a_foreign_app_before_starting_ray(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: []\n")
    with pytest.raises(SystemExit, match="applications"):
        cli_main(["serve", str(bad)])
    mixed = tmp_path / "mixed.yaml"
    config = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    config["applications"].append({"name": "other", "route_prefix": "/other", "import_path": "my.app:build"})
    mixed.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit, match="other is not one: use `serve run`"):
        cli_main(["serve", str(mixed)])


def test_admission_and_draining_bounds_are_checked():
    assert "draining.surge_percent: must be 0-100" in _error(_args(draining={"surge_percent": 101}))
    assert "admission.max_queued_requests" in _error(_args(admission={"max_queued_requests": -1}))
    assert "draining.timeout_s" in _error(_args(draining={"timeout_s": 0}))
    model = parse_config(_args()).models[0]
    assert model.draining.timeout_s == 300 and model.draining.surge_percent == "auto"
    assert model.admission.max_queued_requests == 128


def test_a_context_longer_than_the_builtin_model_allows_is_refused_before_deploying():
    """vLLM would refuse it in every replica after the deploy, leaving a model that never starts."""
    message = _error({"models": [{"name": "e", "source": "builtin:all-minilm-l6-v2", "task": "embed",
                                  "engine": {"max_model_len": 2048}}]})
    assert "max_model_len 2048 exceeds what builtin:all-minilm-l6-v2 allows (256)" in message
    parse_config({"models": [{"name": "e", "source": "builtin:all-minilm-l6-v2", "task": "embed",
                              "engine": {"max_model_len": 256}}]})
    default = parse_config({"models": [{"name": "e", "source": "builtin:all-minilm-l6-v2", "task": "embed"}]})
    assert default.models[0].engine.max_model_len == 256, "the default context shrinks to what the model allows"
