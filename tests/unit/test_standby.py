"""Warm standby replicas (shunter.ops.standby): the plan asks Ray for them on top of the need, the policy
names which running replicas serve and writes that down, the gateway hands it to its routers, and the
router guard sends a standby nothing while a serving replica can take the request. The e2e side (a standby
taking a model's first request from zero, then named serving) is tests/e2e/test_standby.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from shunter.config import RoutingConfig, parse_config
from shunter.ops import standby
from shunter.ops.autoscaling import QueueDepthPolicy
from shunter.routing.routers import LeastConnectionsRouter
from shunter.routing.state import DeploymentRouting
from shunter.serve_plan import ClusterView, plan_deployments
from tests.unit.test_backlog import DictStore

SMOL = {"name": "s", "source": "builtin:smollm2-135m-instruct", "cpu_cores_per_replica": 1}


def _scaling(model: dict) -> dict:
    cfg = parse_config({"models": [model]})
    return plan_deployments(cfg, ClusterView(has_gpus=False, largest_node_cpus=8))["s"]["default"]["deployment"]


def test_the_plan_asks_ray_for_the_standby_replicas_on_top_of_the_need():
    options = _scaling({**SMOL, "standby_replicas": 1, "autoscaling": {"min_replicas": 0, "max_replicas": 2}})
    scaling = options["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["initial_replicas"]) == (1, 3, 1), \
        "from zero, one warm replica and nothing serving"
    assert scaling["policy"]["policy_kwargs"]["standby_replicas"] == 1
    fixed = _scaling({**SMOL, "replicas": 2, "standby_replicas": 1})["autoscaling_config"]
    assert (fixed["min_replicas"], fixed["max_replicas"], fixed["initial_replicas"]) == (3, 3, 3), \
        "a fixed count is scaled by the policy too, which names the serving replicas"
    assert "autoscaling_config" not in _scaling({**SMOL, "replicas": 2}), "no standby: Ray's fixed count, as before"


def test_standby_replicas_count_against_the_nodes_cores():
    from shunter.config import ConfigError

    cfg = parse_config({"models": [{**SMOL, "replicas": 2, "standby_replicas": 1}]})
    with pytest.raises(ConfigError, match="standby_replicas"):
        plan_deployments(cfg, ClusterView(has_gpus=False, largest_node_cpus=2, cpus_fixed=True))


def test_the_serving_replicas_are_those_seen_running_first_and_keep_their_place():
    named, seen = standby.serving_set(["b", "a"], {}, 1, now=10.0)
    assert named == ["a"], "seen together: by id"
    named, seen = standby.serving_set(["b", "c", "a"], seen, 2, now=20.0)
    assert named == ["a", "b"], "a newcomer (c) stands by"
    named, seen = standby.serving_set(["b", "c"], seen, 2, now=30.0)
    assert named == ["b", "c"] and "a" not in seen, "a gone: the standby serves in its place"
    assert standby.serving_set(["b", "c"], seen, 0, now=40.0)[0] == [], "from zero: none serves"


def _ctx(running: list[str], target: int, engine: dict, now: float, state: dict | None = None):
    return SimpleNamespace(current_num_replicas=len(running), target_num_replicas=target,
                           running_replicas=[SimpleNamespace(unique_id=r) for r in running],
                           aggregated_metrics={"engine_requests": engine}, total_queued_requests=0,
                           total_num_requests=0, current_time=now, policy_state=state or {},
                           app_name="app", deployment_name="model-s")


def test_the_policy_adds_the_standby_and_names_the_serving_replicas(monkeypatch):
    store = DictStore()
    monkeypatch.setattr(standby, "RayStore", lambda: store)
    policy = QueueDepthPolicy(model="s", min_replicas=0, max_replicas=2, target_per_replica=4,
                              upscale_delay_s=0, downscale_delay_s=30, standby_replicas=1)
    replicas, state = policy(_ctx(["w"], 1, {}, now=1.0))
    assert replicas == 1, "nothing waiting: the warm replica alone"
    assert standby.read("app", store) == {"model-s": {"serving": frozenset(), "standby": {"w"}}}
    replicas, state = policy(_ctx(["w"], 1, {"w": 3}, now=2.0, state=state))
    assert replicas == 2, "requests from zero: the standby serves, and Ray starts another behind it"
    assert standby.read("app", store)["model-s"] == {"serving": {"w"}, "standby": frozenset()}
    replicas, state = policy(_ctx(["w", "n"], 2, {"w": 3}, now=3.0, state=state))
    assert replicas == 2 and standby.read("app", store)["model-s"] == {"serving": {"w"}, "standby": {"n"}}
    replicas, state = policy(_ctx(["n"], 2, {"n": 3}, now=4.0, state=state))
    assert standby.read("app", store)["model-s"] == {"serving": {"n"}, "standby": frozenset()}, \
        "the serving replica died: the standby serves in its place, and Ray replaces the dead one"
    writes = store.writes
    policy(_ctx(["n"], 2, {"n": 3}, now=5.0, state=state))
    assert store.writes == writes, "the same names are not written again"


def test_readiness_probes_before_the_engines_report_do_not_name_the_standby_serving(monkeypatch):
    """Before a replica's first report Ray's count of ongoing calls stands in for the engines' queues, and
    right after a deploy those calls are the gateways' /ready probes: with a standby they would name it
    serving (and hold it there for the downscale delay) with no load at all."""
    store = DictStore()
    monkeypatch.setattr(standby, "RayStore", lambda: store)
    policy = QueueDepthPolicy(model="s", min_replicas=0, max_replicas=2, target_per_replica=4,
                              upscale_delay_s=0, downscale_delay_s=30, standby_replicas=1)
    ctx = _ctx(["w"], 1, {}, now=1.0)
    ctx.aggregated_metrics, ctx.total_num_requests = {}, 2  # no report yet; two probes in flight
    assert policy(ctx)[0] == 1
    assert standby.read("app", store)["model-s"]["serving"] == frozenset()


def test_a_malformed_entry_is_plain_routing_for_its_deployment():
    store = DictStore()
    store.put(b"serving/app/model-a", b"not json")
    store.put(b"serving/app/model-b", json.dumps({"serving": ["r1"], "standby": ["r2"]}).encode())
    assert standby.read("app", store) == {"model-b": {"serving": {"r1"}, "standby": {"r2"}}}


def _guard(serving: set[str] | None, standby_set: set[str] = frozenset()) -> LeastConnectionsRouter:
    router = object.__new__(LeastConnectionsRouter)  # the guard alone: no Ray router behind it
    router._shunter = DeploymentRouting("m", "least_connections", RoutingConfig())
    if serving is not None:
        router._shunter.set_serving(serving, standby_set)
    return router


def _ids(router: LeastConnectionsRouter, *candidates: str, avoid: tuple[str, ...] = ()) -> list[str]:
    from shunter.replica_protocol import RouteHint

    pending = None
    if avoid:
        pending = SimpleNamespace(args=(RouteHint(avoid=avoid),), kwargs={})
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=i)) for i in candidates]
    return [r.replica_id.unique_id for r in router._guard(replicas, pending)]


def test_the_guard_sends_a_standby_nothing_while_a_serving_replica_can_take_it():
    assert _ids(_guard({"a"}, {"s"}), "a", "s") == ["a"]
    assert _ids(_guard(None), "a", "s") == ["a", "s"], "no serving set named: every replica serves"


def test_a_standby_serves_at_once_when_no_serving_replica_can():
    assert _ids(_guard({"a"}, {"s"}), "s") == ["s"], "the serving replica died: the standby takes it now"
    assert _ids(_guard(set(), {"s"}), "s") == ["s"], "from zero: the standby takes the first request"
    assert _ids(_guard({"a"}, {"s"}), "a", "s", avoid=("a",)) == ["s"], \
        "a retry of a request the serving replica failed goes to the standby, not back"


def test_admission_counts_the_serving_replicas_not_the_standby():
    routing = DeploymentRouting("m", "least_connections", RoutingConfig())
    routing.sync_replicas(["a", "s"], {})
    assert routing.routable() == 2, "nothing named: every running replica takes requests"
    routing.set_serving({"a"}, {"s"})
    assert routing.routable() == 1
    routing.sync_replicas(["s"], {})
    assert routing.routable() == 1, "the serving replica gone: the standby takes requests"


def test_the_coldstart_benchs_table_shows_a_standby_answer_without_start_phases():
    from shunter.cli.bench_coldstart import table

    phases = {"process": 1.0, "engine_processes": 4.0}
    rows = [{"scenario": "replica killed", "path": "fork-server", "seconds": 10.0, "serve": 0.5, "phases": phases,
             "router": 1.0},
            {"scenario": "replica killed", "path": "spawn", "seconds": 40.0, "serve": 0.5, "phases": phases,
             "router": 1.0},
            {"scenario": "replica killed, standby", "path": "fork-server + standby", "seconds": 0.42, "serve": 0.0,
             "phases": {}, "router": 0.42}]
    text = table(rows)
    assert "| replica killed, standby | fork-server + standby | **0.42** | - |" in text
    assert "spawn / fork-server: replica killed: 4.0x" in text
