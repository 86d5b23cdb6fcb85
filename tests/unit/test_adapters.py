"""LoRA adapters in the config: where they come from, their names, ranks, and how requests and keys name
them (issue 24, in progress: the e2e tests with real adapters come with the adapter-aware router)."""

from __future__ import annotations

import json

import pytest

from shunter.config import parse_config
from shunter.deployments.access import AccessControl
from shunter.engine import EngineSpec

pytestmark = pytest.mark.unit


def _adapter_dir(root, name: str, rank: int = 8):
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    return str(path)


def _config(tmp_path, adapters=None, **extra):
    adapters = adapters if adapters is not None else [
        {"name": "legal", "source": _adapter_dir(tmp_path, "legal")},
        {"name": "medical", "source": _adapter_dir(tmp_path, "medical")}]
    return parse_config({"models": [{"name": "chat", "aliases": ["smol"], "source": "builtin:smollm2-135m-instruct",
                                     "adapters": adapters}], **extra})


def test_adapters_are_found_by_name_and_as_base_colon_adapter(tmp_path):
    cfg = _config(tmp_path)
    for name in ("legal", "chat:legal", "smol:legal"):
        model, adapter = cfg.find_adapter(name)
        assert (model.name, adapter.name) == ("chat", "legal")
    assert cfg.find_adapter("other:legal") is None and cfg.find_adapter("chat") is None
    assert cfg.find_model("legal") is None  # a model lookup never returns an adapter's base


@pytest.mark.parametrize("adapters, says", [
    ([{"name": "x", "source": "/no/such/adapter"}], "not a LoRA adapter directory"),
    ([{"name": "a:b", "source": "{dir}"}], "should match pattern"),
    ([{"name": "chat", "source": "{dir}"}], "must be unique"),
    ([{"name": "smol", "source": "{dir}"}], "must be unique"),
    ([{"name": "x", "source": "{dir}"}, {"name": "x", "source": "{dir}"}], "names repeat"),
    ([{"name": "x", "source": "{big}"}], "raise engine.max_lora_rank to at least 64"),
])
def test_bad_adapters_fail_before_anything_starts(tmp_path, adapters, says):
    small, big = _adapter_dir(tmp_path, "small"), _adapter_dir(tmp_path, "big", rank=64)
    adapters = [{k: v.format(dir=small, big=big) for k, v in a.items()} for a in adapters]
    with pytest.raises(Exception, match=says):
        _config(tmp_path, adapters)


def test_an_embedding_model_takes_no_adapters(tmp_path):
    with pytest.raises(Exception, match="embed model takes none"):
        parse_config({"models": [{"name": "e", "task": "embed", "source": "builtin:all-minilm-l6-v2",
                                  "adapters": [{"name": "x", "source": _adapter_dir(tmp_path, "x")}]}]})


def test_the_engine_runs_lora_only_for_a_model_with_adapters(tmp_path):
    model = _config(tmp_path).models[0]
    spec = EngineSpec("chat", "/m", "generate", model.engine, "cpu", adapters=(("legal", "/a"),))
    args = spec.engine_args()
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"], args["max_cpu_loras"]) == (True, 4, 16, None)
    assert "enable_lora" not in EngineSpec("chat", "/m", "generate", model.engine, "cpu").engine_args()
    with pytest.raises(Exception, match="set by Shunter"):
        parse_config({"models": [{"name": "c", "source": "builtin:smollm2-135m-instruct",
                                  "engine": {"extra_engine_args": {"max_loras": 2}}}]})


def test_a_key_may_name_an_adapter_and_then_uses_only_that_one(tmp_path):
    cfg = _config(tmp_path, auth={"keys": [{"name": "legal-team", "key_env": "K", "models": ["chat:legal"]}]})
    caller = AccessControl(cfg, environ={"K": "sk-" + "a" * 40}).client({"authorization": "Bearer sk-" + "a" * 40})
    assert caller.may_use("legal") and not caller.may_use("medical") and not caller.may_use("chat")
    with pytest.raises(Exception, match="not served models, aliases or adapters"):
        parse_config({"models": [{"name": "c", "source": "builtin:smollm2-135m-instruct"}],
                      "auth": {"keys": [{"name": "k", "key_env": "K", "models": ["legal"]}]}})
