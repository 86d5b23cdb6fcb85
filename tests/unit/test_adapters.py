"""LoRA adapters in the config and the gateway: where they come from, their names, ranks, how requests and
keys name them, and the operator's additions and removals over the config (the control state). Real
adapters on real engines: tests/e2e/test_routing_adapters.py."""

from __future__ import annotations

import json

import pytest

from shunter.config import parse_config
from shunter.deployments.gateway.access import AccessControl
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
    ([{"name": "a:b", "source": "{dir}"}], "adapter name is letters, digits"),
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


BAD_ADAPTER_NAMES = ["sec2/slash", "a:b", ".", "..", "-lead", ".hidden", "a b", "a%2Fb", "a\n", "é", "a" * 129, ""]


@pytest.mark.parametrize("name", BAD_ADAPTER_NAMES)
def test_an_adapter_name_is_one_url_path_segment_in_the_config(tmp_path, name):
    """Every name the admin API accepts it can remove: no `/` (no route carries it), no `:`, no dot segment."""
    with pytest.raises(Exception, match=r"adapter name is letters, digits.*\(pattern \^"):
        _config(tmp_path, [{"name": name, "source": _adapter_dir(tmp_path, "x")}])


def test_url_safe_adapter_names_pass_everywhere(tmp_path):
    from shunter.config.adapters import adapter_name_problem

    for name in ("legal", "a.b_c-1", "v2.0", "A" * 128, "x..y"):
        assert adapter_name_problem(name) is None, name
    cfg = _config(tmp_path, [{"name": "a.b_c-1", "source": _adapter_dir(tmp_path, "x")}])
    assert cfg.find_adapter("chat:a.b_c-1") is not None


@pytest.mark.parametrize("name", BAD_ADAPTER_NAMES)
def test_the_admin_api_refuses_a_name_its_routes_cannot_carry(tmp_path, name):
    """POST /admin/models/{model}/adapters: a 400 naming the field and the pattern, before anything is saved."""
    from shunter.config.adapters import ADAPTER_NAME_PATTERN
    from shunter.deployments.gateway.admin_schema import AdapterBody, parse_body
    from shunter.deployments.gateway.lora import LiveAdapters
    from shunter.errors import ApiError

    with pytest.raises(ApiError) as refused:
        parse_body(AdapterBody, {"name": name, "source": _adapter_dir(tmp_path, "x")})
    error = refused.value.body()["error"]
    assert refused.value.status == 400 and error["param"] == "name", error
    assert ADAPTER_NAME_PATTERN in error["message"] and (len(name) < 3 or name not in error["message"]), error
    cfg = parse_config({"models": [{"name": "chat", "source": "builtin:smollm2-135m-instruct",
                                    "engine": {"enable_lora": True}}]})
    with pytest.raises(ApiError) as refused:  # the same check again where the gateway takes the addition
        LiveAdapters(cfg).check_addition(cfg.models[0], name)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "name", "invalid_adapter_name")


def test_a_bad_name_in_adapter_dirs_or_the_control_state_is_skipped_never_served(tmp_path, caplog):
    from shunter.deployments.gateway.lora import LiveAdapters
    from shunter.ops.control import with_adapter

    folder = tmp_path / "tunes"
    folder.mkdir()
    for name in ("good.v1", "a:b", "..x", "-x", "é"):
        _adapter_dir(folder, name)
    cfg = parse_config({"models": [{"name": "chat", "source": "builtin:smollm2-135m-instruct",
                                    "adapter_dirs": [str(folder)]}]})
    model = cfg.models[0]
    with caplog.at_level("WARNING", logger="ray.serve"):
        live = LiveAdapters(cfg)
        assert [a.name for a in live.of(model)] == ["good.v1"]
        assert sum("adapter name is letters, digits" in r.getMessage() for r in caplog.records) == 4
        # One saved by an older gateway that let `/` through: not served either (and said so once).
        state = {"adapters": with_adapter({}, "chat", model.adapters_fingerprint(), "sec2/slash", str(folder / "good.v1"))}
        live.refresh(state)
        live.refresh(state)
    assert live.find("sec2/slash") is None and [a.name for a in live.of(model)] == ["good.v1"]
    assert sum("sec2/slash" in r.getMessage() for r in caplog.records) == 1


def test_an_embedding_model_takes_no_adapters(tmp_path):
    with pytest.raises(Exception, match="embed model takes none"):
        parse_config({"models": [{"name": "e", "task": "embed", "source": "builtin:all-minilm-l6-v2",
                                  "adapters": [{"name": "x", "source": _adapter_dir(tmp_path, "x")}]}]})


def test_the_engine_runs_lora_for_a_model_with_adapters_or_enable_lora(tmp_path):
    model = _config(tmp_path).models[0]
    assert model.lora
    spec = EngineSpec("chat", "/m", "generate", model.engine, "cpu", lora=model.lora, adapters=(("legal", "/a"),))
    args = spec.engine_args()
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"], args["max_cpu_loras"]) == (True, 4, 16, None)
    assert "enable_lora" not in EngineSpec("chat", "/m", "generate", model.engine, "cpu").engine_args()
    plain = {"name": "c", "source": "builtin:smollm2-135m-instruct"}
    assert not parse_config({"models": [plain]}).models[0].lora
    assert parse_config({"models": [{**plain, "engine": {"enable_lora": True}}]}).models[0].lora, \
        "no adapters yet: the admin API adds them"
    with pytest.raises(Exception, match="enable_lora is false"):
        parse_config({"models": [{**plain, "engine": {"enable_lora": False},
                                  "adapters": [{"name": "x", "source": _adapter_dir(tmp_path, "x")}]}]})
    with pytest.raises(Exception, match="set by Shunter"):
        parse_config({"models": [{"name": "c", "source": "builtin:smollm2-135m-instruct",
                                  "engine": {"extra_engine_args": {"max_loras": 2}}}]})


def test_a_key_may_name_an_adapter_and_then_uses_only_that_one(tmp_path):
    cfg = _config(tmp_path, auth={"keys": [{"name": "legal-team", "key_env": "K", "models": ["chat:legal"]}]})
    caller = AccessControl(cfg, environ={"K": "sk-" + "a" * 40}).client({"authorization": "Bearer sk-" + "a" * 40})
    assert caller.may_use("legal") and not caller.may_use("medical") and not caller.may_use("chat")
    with pytest.raises(Exception, match="not served models, aliases, adapters"):
        parse_config({"models": [{"name": "c", "source": "builtin:smollm2-135m-instruct"}],
                      "auth": {"keys": [{"name": "k", "key_env": "K", "models": ["legal"]}]}})


def test_a_key_naming_model_star_uses_every_adapter_of_it_but_not_the_model(tmp_path):
    cfg = _config(tmp_path, auth={"keys": [{"name": "tuners", "key_env": "K", "models": ["smol:*"]}]})
    caller = AccessControl(cfg, environ={"K": "sk-" + "a" * 40}).client({"authorization": "Bearer sk-" + "a" * 40})
    assert caller.models == frozenset({"chat:*"}), "the alias is canonicalised"
    assert caller.may_use("legal", base="chat") and caller.may_use("added-later", base="chat")
    assert not caller.may_use("chat") and not caller.may_use("legal"), "an adapter is checked with its base"
    with pytest.raises(Exception, match="model that runs LoRA"):
        parse_config({"models": [{"name": "c", "source": "builtin:smollm2-135m-instruct"}],
                      "auth": {"keys": [{"name": "k", "key_env": "K", "models": ["c:*"]}]}})


# ---- the gateway's live table: the config, with an operator's changes ------------------------------------


def test_an_operator_adds_and_removes_adapters_over_the_config(tmp_path):
    from shunter.deployments.gateway.lora import LiveAdapters
    from shunter.ops.control import adapter_changes, with_adapter

    cfg = _config(tmp_path)
    model = cfg.models[0]
    live = LiveAdapters(cfg)
    assert [a.name for a in live.of(model)] == ["legal", "medical"]
    fingerprint = model.adapters_fingerprint()
    new_dir = _adapter_dir(tmp_path, "finance")
    state = {"adapters": with_adapter({}, "chat", fingerprint, "finance", new_dir)}
    state["adapters"] = with_adapter(state, "chat", fingerprint, "legal", None)
    live.refresh(state)
    assert [(a.name, a.origin) for a in live.of(model)] == [("finance", "admin"), ("medical", "config")]
    assert live.find("finance").source == new_dir and live.find("smol:finance").name == "finance"
    assert live.find("legal") is None and live.find("chat:legal") is None and live.find("nope:finance") is None
    # A config that says something else about the adapters starts from the file again.
    assert adapter_changes(state, "chat", "another-fingerprint") == {}


def test_what_an_operator_may_add(tmp_path):
    from shunter.deployments.gateway.lora import LiveAdapters
    from shunter.errors import ApiError

    cfg = parse_config({"models": [
        {"name": "chat", "aliases": ["smol"], "source": "builtin:smollm2-135m-instruct",
         "adapters": [{"name": "legal", "source": _adapter_dir(tmp_path, "legal")}]},
        {"name": "other", "source": "builtin:smollm2-135m-instruct", "engine": {"enable_lora": True}},
        {"name": "plain", "source": "builtin:smollm2-135m-instruct"}]})
    chat, other, plain = cfg.models
    live = LiveAdapters(cfg)
    live.check_addition(chat, "legal")  # new files for one it serves
    live.check_addition(other, "fresh")
    for model, name, code in ((plain, "x", "lora_not_enabled"), (other, "legal", "adapter_name_taken"),
                              (other, "smol", "adapter_name_taken")):
        with pytest.raises(ApiError) as refused:
            live.check_addition(model, name)
        assert refused.value.status == 409 and refused.value.code == code, refused.value.message


def test_adapters_found_in_adapter_dirs_are_served_and_new_ones_appear_at_the_next_scan(tmp_path):
    from shunter.deployments.gateway.lora import SCAN_EVERY_S, LiveAdapters
    from tests.unit.fake_clock import Clock

    folder = tmp_path / "tunes"
    folder.mkdir()
    _adapter_dir(folder, "support")
    _adapter_dir(folder, "chat")  # the model's own name: skipped
    _adapter_dir(folder, "too-big", rank=64)  # above engine.max_lora_rank 16: skipped
    (folder / "not-an-adapter").mkdir()
    (folder / "bad name").mkdir()
    (folder / "bad name" / "adapter_config.json").write_text("{}")
    cfg = parse_config({"models": [{"name": "chat", "source": "builtin:smollm2-135m-instruct",
                                    "adapters": [{"name": "legal", "source": _adapter_dir(tmp_path, "legal")}],
                                    "adapter_dirs": [str(folder)]}]})
    model = cfg.models[0]
    assert model.lora
    clock = Clock(100.0)
    live = LiveAdapters(cfg, clock=clock)
    assert [(a.name, a.origin) for a in live.of(model)] == [("legal", "config"), ("support", "scan")]
    _adapter_dir(folder, "billing")
    live.refresh({})
    assert live.find("billing") is None, "not before the next scan"
    clock.now += SCAN_EVERY_S
    live.refresh({})
    assert live.find("chat:billing").source == str(folder / "billing")
    with pytest.raises(Exception, match="not directories"):
        parse_config({"models": [{"name": "c", "source": "builtin:smollm2-135m-instruct",
                                  "adapter_dirs": [str(tmp_path / "nowhere")]}]})
