"""Draining one replica: the cordon kept in the control state, the router guard that honours it, the
replica's retirement through its health check, and drains that race (shunter.deployments.gateway.replica_admin): two at
once through one gateway, through two gateways, and a release during a drain."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from shunter.config import RoutingConfig
from shunter.deployments.gateway.replica_admin import ReplicaAdmin
from shunter.deployments.replica.model_server import ModelServer
from shunter.errors import ApiError
from shunter.ops.control import ShunterControl, cordoned, with_cordon
from shunter.routing.routers import LeastConnectionsRouter
from shunter.routing.state import DeploymentRouting


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


# ---- drains that race: serialized per model in a gateway, judged again by the control actor ----------

class _ControlActor:
    """The control actor as a gateway calls it (`actor().cordon.remote(...)`), the real class behind it,
    its state in a dict. A cordon waits for `gate` before it reaches the actor."""

    def __init__(self, control: ShunterControl, gate: asyncio.Event | None = None):
        self.control, self.gate = control, gate
        self.calls: list[tuple[str, bool]] = []
        self.called = asyncio.Event()
        self.cordon = SimpleNamespace(remote=self._cordon)

    async def _cordon(self, deployment: str, replica: str, on: bool, *rest: Any) -> list[str]:
        self.calls.append((replica, on))
        self.called.set()
        if self.gate is not None:
            await self.gate.wait()
        return await self.control.cordon(deployment, replica, on, *rest)


class _Traffic:
    """The gateway's LiveVersions as the drain reads it: no rollout, the one version live."""

    def __init__(self, actor: _ControlActor):
        self._actor = actor

    def rollout_active(self, model: Any) -> bool:
        return False

    def view(self, model: Any) -> SimpleNamespace:
        return SimpleNamespace(live=frozenset({"default"}))

    def actor(self) -> _ControlActor:
        return self._actor


class _Server:
    """A ModelServer handle: its deployment's name, and the retirements it was told, in order."""

    deployment_name = "model-m"

    def __init__(self) -> None:
        self.retirements: list[float | None] = []
        self.retire = SimpleNamespace(remote=self._retire)

    async def _retire(self, hint: Any, within_s: float | None, not_before_s: float | None) -> dict[str, Any]:
        self.retirements.append(within_s)
        return {"replica": hint.pin, "retiring": within_s is not None, "unfinished_requests": 0}


MODEL = SimpleNamespace(name="m", versioned=False, autoscaling=None, fewest_replicas=1, standby_replicas=0, version_names=lambda: ["default"])


def _memory_control() -> ShunterControl:
    stored: dict[bytes, bytes] = {}
    control = ShunterControl("app1", store=SimpleNamespace(get=stored.get, put=stored.__setitem__))
    control._ensure_loop = lambda: None  # no rollout loop: only cordons here
    return control


def _gateway(actor: _ControlActor, server: _Server | None = None) -> ReplicaAdmin:
    """One gateway's ReplicaAdmin over a model of two replicas, its own routing state as a router left it."""
    routing = DeploymentRouting("m", "least_connections", RoutingConfig())
    routing.sync_replicas(["r1", "r2"])
    return ReplicaAdmin(_Traffic(actor), {"m": {"default": server or _Server()}}, lambda model, version: routing)


async def _settle() -> None:
    """Let every task run as far as it can without the test."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_two_concurrent_drains_of_the_last_two_replicas_leave_one_routable():
    control = _memory_control()

    actor = _ControlActor(control, gate=asyncio.Event())
    admin = _gateway(actor)

    async def scenario() -> list[Any]:
        drains = [asyncio.create_task(admin.drain(MODEL, r, False, 0.0, False)) for r in ("r1", "r2")]
        await actor.called.wait()  # the first drain awaits its cordon ...
        await _settle()  # ... and the second gets as far as it can meanwhile
        actor.gate.set()
        return await asyncio.gather(*drains, return_exceptions=True)

    first, second = asyncio.run(scenario())
    assert cordoned(control.state, "model-m") == {"r1"}
    assert first == {"model": "m", "version": "default", "replica": "r1", "cordoned": True, "replace": False}
    assert isinstance(second, ApiError) and second.status == 409 and second.code == "last_replica"
    assert actor.calls == [("r1", True)], "the gateway refused the second drain itself, without a call"


def test_a_drain_through_another_gateway_that_has_not_seen_a_cordon_yet_is_refused_by_the_control_actor():
    control = _memory_control()
    actor = _ControlActor(control)
    one, other = _gateway(actor), _gateway(actor)  # two gateway replicas, each with its own routing view

    async def scenario() -> None:
        await one.drain(MODEL, "r1", False, 0.0, False)
        with pytest.raises(ApiError) as refused:
            await other.drain(MODEL, "r2", False, 0.0, False)  # `other` still sees r1 routable
        assert refused.value.status == 409 and refused.value.code == "last_replica"
        assert cordoned(control.state, "model-m") == {"r1"}
        forced = await other.drain(MODEL, "r2", False, 0.0, True)
        assert forced["cordoned"] and cordoned(control.state, "model-m") == {"r1", "r2"}

    asyncio.run(scenario())


def test_a_release_that_arrives_during_a_drain_waits_for_it_and_then_undoes_all_of_it():
    control = _memory_control()
    server = _Server()

    async def scenario() -> None:
        actor = _ControlActor(control, gate=asyncio.Event())
        admin = _gateway(actor, server)
        drain = asyncio.create_task(admin.drain(MODEL, "r1", True, 10.0, False))
        await actor.called.wait()  # the drain awaits its cordon; the operator changes their mind
        release = asyncio.create_task(admin.release(MODEL, "r1"))
        await _settle()
        actor.gate.set()
        await asyncio.gather(drain, release)

    asyncio.run(scenario())
    assert server.retirements == [10.0, None], "the release's cancel comes after the drain's retirement"
    assert cordoned(control.state, "model-m") == frozenset()
