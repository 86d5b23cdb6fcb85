"""Priority classes at the door (issue 38, item 1): which class a request gets, and the config that names
them. A class a key may not use is a 403 (never a silent change of class), an unknown one a 400."""

from __future__ import annotations

from typing import Any

import pytest

from shunter.auth import ANONYMOUS, Caller
from shunter.config import ConfigError, parse_config
from shunter.deployments.gateway.flow.priority import PRIORITY_HEADER, PriorityClasses
from shunter.deployments.gateway.parsed_request import parse
from shunter.endpoints import CHAT, MESSAGES, RESPONSES
from shunter.engine import EngineSpec
from shunter.errors import ApiError

pytestmark = pytest.mark.unit

MODEL = {"name": "chat", "source": "builtin:smollm2-135m-instruct"}
USER = {"role": "user", "content": "hi"}


def config(keys: list[dict[str, Any]] | None = None, **flow: Any) -> Any:
    raw: dict[str, Any] = {"models": [MODEL]}
    if keys is not None:
        raw["auth"] = {"keys": [{"key_env": "K", **k} for k in keys]}
    if flow:
        raw["flow_control"] = flow
    return parse_config(raw)


def caller(cfg: Any, name: str) -> Caller:
    key = next(k for k in cfg.auth.keys if k.name == name)
    return Caller(name=name, key_id="id", config=key)


def chat(**fields: Any) -> Any:
    return parse(CHAT, {"model": "chat", "messages": [USER], **fields})


def refusal(call: Any, *args: Any) -> ApiError:
    with pytest.raises(ApiError) as refused:
        call(*args)
    return refused.value


def test_the_default_classes_and_openais_service_tiers():
    cfg = config()
    assert [c.name for c in cfg.flow_control.classes] == ["interactive", "standard", "batch"]
    classes = PriorityClasses(cfg.flow_control)
    assert classes.resolve(ANONYMOUS, chat(), {}) == "standard"
    assert classes.resolve(ANONYMOUS, chat(service_tier="priority"), {}) == "interactive"
    assert classes.resolve(ANONYMOUS, chat(service_tier="flex"), {}) == "batch"
    assert classes.resolve(ANONYMOUS, chat(), {PRIORITY_HEADER: " batch "}) == "batch"
    # Responses parses service_tier with a default ("auto"): only one the client sent counts.
    assert classes.resolve(ANONYMOUS, parse(RESPONSES, {"model": "chat", "input": "x"}), {}) == "standard"
    # The Messages API has no service_tier: the header names the class.
    messages = parse(MESSAGES, {"model": "chat", "max_tokens": 4, "messages": [USER]})
    assert classes.resolve(ANONYMOUS, messages, {PRIORITY_HEADER: "interactive"}) == "interactive"


def test_a_key_asks_for_its_default_and_less_urgent_classes_but_never_a_more_urgent_one():
    cfg = config([{"name": "jobs", "priority_class": "batch"}, {"name": "app", "priority_class": "interactive"},
                  {"name": "plain"}])
    classes = PriorityClasses(cfg.flow_control)
    jobs, app, plain = caller(cfg, "jobs"), caller(cfg, "app"), caller(cfg, "plain")
    assert classes.resolve(jobs, chat(), {}) == "batch"
    assert classes.resolve(app, chat(), {}) == "interactive"
    assert classes.resolve(app, chat(service_tier="flex"), {}) == "batch", "a key may lower its own class"
    assert classes.resolve(plain, chat(service_tier="flex"), {}) == "batch"
    for who, asked in ((jobs, chat(service_tier="priority")), (jobs, chat(service_tier="default")),
                       (plain, chat(service_tier="priority"))):
        error = refusal(classes.resolve, who, asked, {})
        assert (error.status, error.code, error.param) == (403, "priority_class_not_allowed", "service_tier")
        assert who.name in error.message
    error = refusal(classes.resolve, jobs, chat(), {PRIORITY_HEADER: "interactive"})
    assert error.status == 403


def test_a_keys_explicit_classes_are_the_only_ones_it_may_ask_for():
    cfg = config([{"name": "mixed", "priority_class": "standard", "priority_classes": ["standard", "interactive"]}])
    classes = PriorityClasses(cfg.flow_control)
    mixed = caller(cfg, "mixed")
    assert classes.resolve(mixed, chat(service_tier="priority"), {}) == "interactive"
    assert refusal(classes.resolve, mixed, chat(service_tier="flex"), {}).status == 403


def test_unknown_and_conflicting_classes_are_400s_naming_what_is_served():
    classes = PriorityClasses(config().flow_control)
    error = refusal(classes.resolve, ANONYMOUS, chat(), {PRIORITY_HEADER: "urgent"})
    assert (error.status, error.code) == (400, "unknown_priority_class") and "interactive" in error.message
    error = refusal(classes.resolve, ANONYMOUS, chat(service_tier="scale"), {})
    assert (error.status, error.code, error.param) == (400, "unsupported_service_tier", "service_tier")
    error = refusal(classes.resolve, ANONYMOUS, chat(service_tier="priority"), {PRIORITY_HEADER: "batch"})
    assert (error.status, error.code) == (400, "conflicting_priority")
    assert classes.resolve(ANONYMOUS, chat(service_tier="flex"), {PRIORITY_HEADER: "batch"}) == "batch"
    for odd in (7, "bogus", None):  # vLLM's model takes any value of service_tier as it is
        asked = chat(service_tier=odd)
        if odd is None:
            assert classes.resolve(ANONYMOUS, asked, {}) == "standard", "null: the default, as OpenAI reads it"
        else:
            assert refusal(classes.resolve, ANONYMOUS, asked, {}).code == "unsupported_service_tier"


@pytest.mark.parametrize("flow, keys, says", [
    ({"classes": [{"name": "a", "max_wait_s": 1}, {"name": "a", "max_wait_s": 2}], "default_class": "a",
      "service_tiers": {}}, None, "unique"),
    ({"default_class": "urgent"}, None, "flow_control.default_class"),
    ({"service_tiers": {"premium": "interactive"}}, None, "not an OpenAI service_tier"),
    ({"service_tiers": {"priority": "vip"}}, None, "flow_control.service_tiers.priority"),
    ({}, [{"name": "k", "priority_class": "vip"}], "auth.keys[k]"),
    ({}, [{"name": "k", "priority_class": "batch", "priority_classes": ["standard"]}], "must be among"),
    ({"classes": [{"name": "now", "max_wait_s": 0}]}, None, "max_wait_s"),
    ({"classes": [{"name": "now", "capacity_share": 0.5}], "default_class": "now", "service_tiers": {}}, None,
     "the most urgent class may fill every slot"),
    ({"classes": [{"name": "a"}, {"name": "b", "capacity_share": 0.5}, {"name": "c", "capacity_share": 0.8}],
      "default_class": "a", "service_tiers": {}}, None, "flow_control.classes[c].capacity_share"),
    ({"classes": [{"name": "a", "max_wait_s": 900}], "default_class": "a", "service_tiers": {}}, None,
     "flow_control.classes[a].max_wait_s (900s) must be shorter than gateway.limits.request_timeout_s"),
    ({}, [{"name": "k", "weight": 0}], "weight"),
])
def test_a_config_that_names_a_class_wrongly_says_which_field(flow, keys, says):
    with pytest.raises(ConfigError, match=None) as failed:
        config(keys, **flow)
    assert says in str(failed.value)


def test_the_default_classes_waits_give_way_to_a_shorter_request_timeout():
    cfg = parse_config({"models": [MODEL], "gateway": {"queue_timeout_s": 3, "body_timeout_s": 2, "limits": {
        "request_timeout_s": 8, "stream_idle_timeout_s": 5}}})
    flow = cfg.flow_control
    assert [flow.max_wait_s(c.name, 3, 8) for c in flow.classes] == [8, 3, 8], "interactive, standard, batch"
    assert [(c.capacity_share, c.min_share) for c in flow.classes] == [(1, 0), (1, 0.1), (0.5, 0.05)]


def test_every_version_of_a_model_schedules_alike():
    versions = [{"name": "a", "source": "builtin:smollm2-135m-instruct", "weight": 100},
                {"name": "b", "source": "builtin:smollm2-135m-instruct", "engine": {"scheduling_policy": "priority"}}]
    with pytest.raises(ConfigError) as failed:
        parse_config({"models": [{"name": "chat", "versions": versions}]})
    assert "scheduling_policy" in str(failed.value)
    same = parse_config({"models": [{"name": "chat", "versions": versions, "engine": {"scheduling_policy": "priority"}}]})
    model = same.models[0]
    spec = EngineSpec("chat", "/m", "generate", model.versions[1].engine, "cpu")
    assert spec.engine_args()["scheduling_policy"] == "priority", "the engine is told"


def test_a_config_passed_on_as_a_dict_keeps_the_default_classes_waits_cut():
    """The gateway re-validates the config from its dump, where every field is set."""
    raw = {"models": [MODEL], "gateway": {"queue_timeout_s": 3, "body_timeout_s": 2,
                                          "limits": {"request_timeout_s": 8, "stream_idle_timeout_s": 5}}}
    again = parse_config(parse_config(raw).model_dump())
    assert again.flow_control.default_classes


def test_the_class_read_before_parsing_is_the_one_the_parsed_request_gets_or_none():
    """The door refuses a full model's requests before it parses their bodies (issue 39), by the class read
    from the raw JSON: wherever that read decides, it agrees with `resolve`; where it cannot tell, or the
    request will be refused for its class, it says None and the whole door decides."""
    cfg = config([{"name": "jobs", "priority_class": "batch"}, {"name": "plain"}])
    classes = PriorityClasses(cfg.flow_control)
    jobs, plain = caller(cfg, "jobs"), caller(cfg, "plain")
    bodies = {CHAT: {"model": "chat", "messages": [USER]}, RESPONSES: {"model": "chat", "input": "hi"},
              MESSAGES: {"model": "chat", "max_tokens": 4, "messages": [USER]}}
    cases = [(endpoint, who, fields, headers) for endpoint in bodies for who in (ANONYMOUS, jobs, plain)
             for fields in ({}, {"service_tier": "flex"}, {"service_tier": "priority"}, {"service_tier": None},
                            {"service_tier": "auto"}, {"service_tier": "standard_only"},
                            {"service_tier": "scale"}, {"service_tier": 7}, {"priority": 3}, {"priority": "1"})
             for headers in ({}, {PRIORITY_HEADER: "batch"}, {PRIORITY_HEADER: "urgent"})]
    decided = 0
    for endpoint, who, fields, headers in cases:
        early = classes.early(who, endpoint, {**bodies[endpoint], **fields}, headers)
        try:
            parsed = parse(endpoint, {**bodies[endpoint], **fields})
        except ApiError:
            continue  # a body the door refuses whatever its class (Responses takes no null tier): 400 or 429
        try:
            later = classes.resolve(who, parsed, headers)
        except (ApiError, ValueError):
            later = None
        if early is not None:
            decided += 1
            assert early == later, (endpoint.name, who.name, fields, headers)
    assert decided >= 30
    assert classes.early(jobs, CHAT, {"messages": [USER], "service_tier": ["flex"]}, {}) is None


def test_auto_is_the_callers_default_class_as_at_openai():
    """OpenAI's `auto` is the project's default tier: here the key's default class, whichever it is (it was
    `standard` for every key, so an interactive key's `auto` was a 403)."""
    cfg = config([{"name": "app", "priority_class": "interactive"}, {"name": "jobs", "priority_class": "batch"},
                  {"name": "plain"}])
    classes = PriorityClasses(cfg.flow_control)
    for name, default in (("app", "interactive"), ("jobs", "batch"), ("plain", "standard")):
        for endpoint, body in ((CHAT, {"model": "chat", "messages": [USER]}), (RESPONSES, {"model": "chat", "input": "x"})):
            asked = parse(endpoint, {**body, "service_tier": "auto"})
            assert classes.resolve(caller(cfg, name), asked, {}) == default, (name, endpoint.name)
    assert classes.resolve(ANONYMOUS, chat(service_tier="auto"), {}) == "standard"
    # `auto` beside the header: the header decides, and never conflicts with it.
    assert classes.resolve(caller(cfg, "app"), chat(service_tier="auto"), {PRIORITY_HEADER: "batch"}) == "batch"
    with pytest.raises(ConfigError, match="`auto` cannot be mapped"):
        config(service_tiers={"auto": "batch"})


def test_the_messages_api_takes_anthropics_tiers():
    """Anthropic's `auto` is the caller's default; `standard_only` the same, but never more urgent than the
    class of OpenAI's `default` tier; any other value is a 400 naming the two."""
    cfg = config([{"name": "app", "priority_class": "interactive"}, {"name": "jobs", "priority_class": "batch"}])
    classes = PriorityClasses(cfg.flow_control)

    def messages(**fields: Any) -> Any:
        return parse(MESSAGES, {"model": "chat", "max_tokens": 4, "messages": [USER], **fields})

    app, jobs = caller(cfg, "app"), caller(cfg, "jobs")
    assert classes.resolve(app, messages(service_tier="auto"), {}) == "interactive"
    assert classes.resolve(app, messages(service_tier="standard_only"), {}) == "standard"
    assert classes.resolve(jobs, messages(service_tier="standard_only"), {}) == "batch", "never raised"
    for odd in ("flex", "priority", 3):
        error = refusal(classes.resolve, app, messages(service_tier=odd), {})
        assert (error.status, error.code, error.param) == (400, "unsupported_service_tier", "service_tier")
        assert "standard_only" in error.message


def test_a_reply_says_its_class_tier():
    flow = config().flow_control
    assert [flow.served_tier(c) for c in ("interactive", "standard", "batch")] == ["priority", "default", "flex"]
    custom = config(classes=[{"name": "now"}, {"name": "later", "capacity_share": 0.5}], default_class="now",
                    service_tiers={"scale": "now", "priority": "now"}).flow_control
    assert (custom.served_tier("now"), custom.served_tier("later")) == ("scale", "default")
