"""Draining one replica: the cordon kept in the control state, the router guard that honours it, and the
replica's retirement through its health check (deployments.replica_admin)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from deployments.model_server import ModelServer
from ops.control import cordoned, with_cordon
from routing.routers import LeastConnectionsRouter
from routing.state import DeploymentRouting
from shunter.config import RoutingConfig


def test_a_cordon_is_kept_per_deployment_and_forgets_replicas_that_stopped():
    state = {"cordoned": with_cordon({}, "model-a", "r1", True, ["r1", "r2"])}
    assert cordoned(state, "model-a") == {"r1"} and cordoned(state, "model-b") == frozenset()
    state["cordoned"] = with_cordon(state, "model-b", "x1", True, ["x1"])
    state["cordoned"] = with_cordon(state, "model-a", "r2", True, ["r2", "r3"])  # r1 stopped meanwhile
    assert cordoned(state, "model-a") == {"r2"} and cordoned(state, "model-b") == {"x1"}
    state["cordoned"] = with_cordon(state, "model-a", "r2", False, ["r2", "r3"])
    assert "model-a" not in state["cordoned"] and cordoned(state, "model-b") == {"x1"}


def _guard(cordon: set[str], open_breakers: set[str] = frozenset()) -> LeastConnectionsRouter:
    router = object.__new__(LeastConnectionsRouter)  # the guard alone: no Ray router behind it
    router._shunter = DeploymentRouting("m", "least_connections", RoutingConfig())
    router._shunter.set_cordoned(cordon)
    for replica in open_breakers:
        for _ in range(router._shunter.config.breaker.consecutive_failures):
            router._shunter.record_outcome(replica, failed=True, why="test")
    return router


def _candidates(*ids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(replica_id=SimpleNamespace(unique_id=i)) for i in ids]


def _ids(replicas: list[SimpleNamespace]) -> list[str]:
    return [r.replica_id.unique_id for r in replicas]


def test_the_guard_sends_nothing_new_to_a_cordoned_replica_while_another_can_serve():
    assert _ids(_guard({"a"})._guard(_candidates("a", "b", "c"), None)) == ["b", "c"]


def test_a_cordoned_replica_still_serves_when_no_other_can():
    assert _ids(_guard({"a", "b"})._guard(_candidates("a", "b"), None)) == ["a", "b"]
    assert _ids(_guard({"a"}, open_breakers={"b"})._guard(_candidates("a", "b"), None)) == ["a"]


class _Engine:
    """Stands in for the engine's two answers the retirement reads; not an engine."""

    def __init__(self, unfinished: int):
        self.unfinished = unfinished

    def num_unfinished_requests(self) -> int:
        return self.unfinished

    async def check_health(self) -> None:
        return None


def _replica(unfinished: int) -> ModelServer:
    server = object.__new__(ModelServer)  # no engine start: only what the retirement reads
    server.model = SimpleNamespace(name="m")
    server.version, server.replica_id, server._retire = "default", "r1", None
    server.engine = _Engine(unfinished)
    return server


def _healthy(server: ModelServer) -> bool:
    try:
        asyncio.run(server.check_health())
    except RuntimeError as exc:
        assert "drained by an operator" in str(exc)
        return False
    return True


def test_a_retiring_replica_fails_its_health_check_once_idle():
    server = _replica(unfinished=2)
    assert _healthy(server)
    assert server.retire(None, 60.0, 0.0) == {"replica": "r1", "retiring": True, "unfinished_requests": 2}
    assert _healthy(server), "busy and within its time: it keeps serving what it holds"
    server.engine.unfinished = 0
    assert not _healthy(server)


def test_a_retiring_replica_waits_for_the_cordon_to_spread_and_gives_up_on_stragglers_at_the_deadline():
    server = _replica(unfinished=0)
    server.retire(None, 60.0, 30.0)
    assert _healthy(server), "gateways may not all have seen the cordon yet"
    server = _replica(unfinished=3)
    server.retire(None, 0.0, 0.0)
    assert not _healthy(server)


@pytest.mark.parametrize("unfinished", [0, 3])
def test_a_cancelled_retirement_keeps_the_replica(unfinished):
    server = _replica(unfinished)
    server.retire(None, 0.0, 0.0)
    server.retire(None, None, None)
    assert _healthy(server)
