"""Routing config: policy defaults and checks, and the Ray request_router_config built from them."""

from __future__ import annotations

import importlib

import pytest

from shunter.config import BreakerConfig, ConfigError, RoutingConfig, parse_config
from shunter.deployments.app import request_router_config
from shunter.ray_compat import POWER_OF_TWO_ROUTER
from shunter.routing.routers import ShunterGuard

SMOL = {"name": "smol", "source": "builtin:smollm2-135m-instruct"}
MINI = {"name": "mini", "source": "builtin:all-minilm-l6-v2", "task": "embed"}
POW2 = POWER_OF_TWO_ROUTER  # Ray's own router, by import path: a custom router a user could name


def _model(base=SMOL, **overrides):
    return parse_config({"models": [{**base, **overrides}]}).models[0]


def _error(base=SMOL, **overrides) -> str:
    with pytest.raises(ConfigError) as info:
        _model(base, **overrides)
    return str(info.value)


# ---- RoutingConfig / BreakerConfig ----------------------------------------------------------------


def test_default_policy_follows_the_task():
    assert _model(SMOL).routing_policy == "prefix_aware"
    assert _model(MINI).routing_policy == "least_connections"
    assert _model(SMOL, engine={"enable_prefix_caching": False}).routing_policy == "least_connections"
    assert _model(MINI, routing={"policy": "power_of_two"}).routing_policy == "power_of_two"


def test_default_routing_and_breaker_settings():
    routing = _model().routing
    assert routing.policy is None and routing.retry_once is True
    assert routing.load_cost_tokens > 0 and routing.max_load_gap > 0
    assert routing.breaker == BreakerConfig()
    breaker = routing.breaker
    assert breaker.enabled and breaker.consecutive_failures >= 1 and 0 < breaker.error_rate <= 1
    assert breaker.cooldown_s > 0 and breaker.half_open_probes >= 1


def test_embed_model_rejects_prefix_aware():
    msg = _error(MINI, routing={"policy": "prefix_aware"})
    assert "prefix_aware needs prefix caching" in msg
    assert _model(MINI, routing={"policy": "prefix_aware"},
                  engine={"enable_prefix_caching": True}).routing_policy == "prefix_aware"


def test_custom_needs_router_class():
    assert "policy custom needs router_class" in _error(routing={"policy": "custom"})
    model = _model(routing={"policy": "custom", "router_class": POW2, "router_kwargs": {"k": 1}})
    assert model.routing_policy == "custom" and model.routing.router_kwargs == {"k": 1}


@pytest.mark.parametrize("routing", [
    {"router_class": POW2},
    {"policy": "least_connections", "router_class": POW2},
    {"policy": "prefix_aware", "router_kwargs": {"k": 1}},
])
def test_router_class_and_kwargs_only_with_custom(routing):
    assert "apply to policy custom only" in _error(routing=routing)


def test_router_class_must_look_like_an_import_path():
    assert "must look like" in _error(routing={"policy": "custom", "router_class": "not a path"})
    assert _model(routing={"policy": "custom", "router_class": "pkg.mod.Router"}).routing.router_class


@pytest.mark.parametrize("breaker, field", [
    ({"consecutive_failures": 0}, "consecutive_failures"),
    ({"error_rate": 0}, "error_rate"),
    ({"error_rate": 1.5}, "error_rate"),
    ({"cooldown_s": 0}, "cooldown_s"),
    ({"half_open_probes": 0}, "half_open_probes"),
    ({"cooldown": 5}, "cooldown"),
])
def test_bad_breaker_settings_name_the_field(breaker, field):
    assert f"models[0].routing.breaker.{field}" in _error(routing={"breaker": breaker})


def test_unknown_policy_is_rejected():
    msg = _error(routing={"policy": "round_robin"})
    assert "models[0].routing.policy" in msg and "'least_connections'" in msg


def test_routing_config_round_trips_through_json():
    routing = _model(routing={"max_load_gap": 2, "breaker": {"cooldown_s": 3}}).routing
    assert RoutingConfig.model_validate(routing.model_dump(mode="json")) == routing


# ---- request_router_config ------------------------------------------------------------------------


@pytest.mark.parametrize("base, policy, path", [
    (SMOL, None, "shunter.routing.routers:PrefixAwareRouter"),
    (MINI, None, "shunter.routing.routers:LeastConnectionsRouter"),
    (SMOL, "least_connections", "shunter.routing.routers:LeastConnectionsRouter"),
    (SMOL, "power_of_two", "shunter.routing.routers:PowerOfTwoRouter"),
])
def test_policy_selects_its_router_class(base, policy, path):
    model = _model(base, routing={"policy": policy} if policy else {})
    config = request_router_config(model, "cpu")
    assert config["request_router_class"] == path
    module, _, name = path.partition(":")
    assert issubclass(getattr(importlib.import_module(module), name), ShunterGuard)


def test_router_kwargs_carry_what_the_router_needs():
    model = _model(routing={"max_load_gap": 3, "stats_period_s": 5})
    config = request_router_config(model, "cpu")
    spec = config["request_router_kwargs"]["shunter"]
    assert spec["model"] == "smol" and spec["policy"] == "prefix_aware"
    assert RoutingConfig.model_validate(spec["routing"]) == model.routing
    assert config["request_routing_stats_period_s"] == 5


def test_custom_router_is_wrapped_in_the_guard():
    model = _model(routing={"policy": "custom", "router_class": POW2, "router_kwargs": {"k": 1}})
    config = request_router_config(model, "gpu")
    path = config["request_router_class"]
    module, _, name = path.partition(":")
    assert module == "shunter.routing.custom" and name.startswith("G_")
    assert bytes.fromhex(name[2:]).decode() == POW2
    guarded = getattr(importlib.import_module(module), name)
    pow2 = getattr(importlib.import_module(POW2.partition(":")[0]), POW2.partition(":")[2])
    assert issubclass(guarded, ShunterGuard) and issubclass(guarded, pow2)
    assert guarded.__mro__.index(ShunterGuard) < guarded.__mro__.index(pow2)  # the guard runs first
    assert getattr(importlib.import_module(module), name) is guarded  # built once per process
    kwargs = config["request_router_kwargs"]
    assert kwargs["k"] == 1 and kwargs["shunter"]["policy"] == "custom"


@pytest.mark.parametrize("router_class", ["no_such_pkg.mod:Router", "shunter.routing.policy:NoSuchRouter",
                                          "shunter.routing.prefix:CHARS_PER_TOKEN"])
def test_unimportable_router_class_is_a_config_error(router_class):
    model = _model(routing={"policy": "custom", "router_class": router_class})
    with pytest.raises(ConfigError, match=r"models\[smol\]\.routing\.router_class") as info:
        request_router_config(model, "cpu")
    assert router_class in str(info.value)


def test_block_size_defaults_by_accelerator_and_engine_args_win(monkeypatch):
    # Skip checking extra_engine_args against vLLM (importing it takes seconds; test_config covers it).
    monkeypatch.setattr("shunter.config.engine._vllm_engine_arg_names", frozenset)

    def block_size(model, accelerator):
        return request_router_config(model, accelerator)["request_router_kwargs"]["shunter"]["block_size"]

    assert block_size(_model(), "cpu") == 128
    assert block_size(_model(), "gpu") == 16
    explicit = _model(engine={"extra_engine_args": {"block_size": 32}})
    assert block_size(explicit, "cpu") == 32 and block_size(explicit, "gpu") == 32
