"""Draining one replica on an operator's word: the admin API's `replicas` endpoints.

A drain cordons the replica in the cluster's control state (`shunter.ops.control`), so the routers of every
gateway send it nothing new while another replica of its version can take it (`shunter.routing.routers`).
Unless the operator says otherwise, the replica is also told to retire. Once it holds no request (or
the drain timeout has passed), its health check fails and Ray Serve replaces it, stopping it through
its graceful shutdown. Nothing it holds is cut: requests in flight finish there, and Serve's graceful
shutdown waits for any that reached it before every gateway saw the cordon (within a second).

The cordon is dropped when the replica is gone: its replacement starts with a new id and takes traffic.

Drains and releases of one model run one at a time in a gateway: a drain checks that another replica
stays routable, then awaits the control actor's cordon, so two drains let through together could each
count the other's replica as the one that stays, and cordon both. Across gateways (each sees the
others' cordons only at its next read of the state) the control actor judges the same check again, on
the one copy of the cordons.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from shunter.config import ModelConfig
from shunter.errors import ApiError
from shunter.ops.control import LastReplica, cordoned
from shunter.replica_protocol import RouteHint
from shunter.routing.state import DeploymentRouting

log = logging.getLogger("ray.serve")

# A replica retires no earlier than this after the cordon: every gateway reads the control state once a
# second, so by then none sends it a new request.
CORDON_SEEN_S = 3.0
_CALL_TIMEOUT_S = 30.0


class ReplicaAdmin:
    def __init__(self, traffic: Any, servers: dict[str, dict[str, Any]],
                 routing: Callable[[ModelConfig, str], DeploymentRouting]):
        """`traffic`: the gateway's LiveVersions (control state, the control actor); `servers`: model ->
        version -> ModelServer handle; `routing`: the gateway's routing state of a model version."""
        self.traffic = traffic
        self.servers = servers
        self.routing = routing
        self._locks: dict[str, asyncio.Lock] = {}  # model -> held by its drain or release in progress

    def apply_cordons(self, state: dict[str, Any], models: list[ModelConfig]) -> None:
        """Hand the control state's cordons to this process's routers (called on every refresh)."""
        for model in models:
            for version, handle in self.servers[model.name].items():
                self.routing(model, version).set_cordoned(cordoned(state, handle.deployment_name))

    def apply_serving(self, serving_sets: dict[str, dict[str, frozenset[str]]], models: list[ModelConfig]) -> None:
        """Hand the autoscaling policy's serving sets (`shunter.ops.standby`) to this process's routers, for
        the models that keep standby replicas (called on every refresh)."""
        for model in models:
            if not model.standby_replicas:
                continue
            for version, handle in self.servers[model.name].items():
                entry = serving_sets.get(handle.deployment_name)
                if entry is not None:
                    self.routing(model, version).set_serving(entry["serving"], entry["standby"])

    async def replicas(self, model: ModelConfig) -> list[dict[str, Any]]:
        """Every running replica of the model's versions as this gateway sees it."""
        rows = []
        for version in model.version_names():
            routing = await self._known(model, version)
            for replica in sorted(routing.replicas):
                rows.append({"replica": replica, "version": version, "cordoned": replica in routing.cordoned,
                             "standby": replica in routing.standby,
                             "in_flight_here": routing.load(replica),
                             "breaker": routing.breakers.state(replica).value,
                             "failures": routing.breakers.failures.get(replica, 0)})
        return rows

    async def drain(self, model: ModelConfig, replica: str, replace: bool, within_s: float,
                    force: bool) -> dict[str, Any]:
        async with self._lock(model):  # the check below must see the cordon of a drain before it
            return await self._drain(model, replica, replace, within_s, force)

    async def release(self, model: ModelConfig, replica: str) -> dict[str, Any]:
        """Undo a drain: the replica takes new requests again and, if it was told to retire, stays."""
        async with self._lock(model):  # not between a drain's cordon and its retirement
            version, routing = await self._find(model, replica)
            handle = self.servers[model.name][version]
            await self._pinned(handle.retire, replica, None, None)
            await self._cordon(handle.deployment_name, replica, False, routing)
        log.warning("model %s version %s: replica %s released by an operator", model.name, version, replica)
        return {"model": model.name, "version": version, "replica": replica, "cordoned": False}

    # ---- parts ----------------------------------------------------------------------------------------

    def _lock(self, model: ModelConfig) -> asyncio.Lock:
        return self._locks.setdefault(model.name, asyncio.Lock())

    async def _drain(self, model: ModelConfig, replica: str, replace: bool, within_s: float,
                     force: bool) -> dict[str, Any]:
        version, routing = await self._find(model, replica)
        if self.traffic.rollout_active(model):
            raise ApiError(409, f"model {model.name!r} has a rollout in progress; drain its replicas after it "
                           "ends, or roll it back", param="model", code="rollout_in_progress")
        if not routing.replicas - routing.cordoned - {replica} and not force:
            raise _last_replica(model, version, replica)
        handle = self.servers[model.name][version]
        try:
            await self._cordon(handle.deployment_name, replica, True, routing, keep_one=not force)
        except LastReplica:  # another gateway cordoned the other replicas, and this one has not seen it yet
            raise _last_replica(model, version, replica) from None
        answer: dict[str, Any] = {"model": model.name, "version": version, "replica": replica, "cordoned": True,
                                  "replace": replace}
        if replace:
            within_s = max(within_s, CORDON_SEEN_S)  # what the replica is told, and so what the answer says
            reply = await self._pinned(handle.retire, replica, within_s, CORDON_SEEN_S)
            answer.update(retire_within_s=within_s, unfinished_requests=reply.get("unfinished_requests"))
        log.warning("model %s version %s: replica %s drained by an operator (%s)", model.name, version, replica,
                    f"replaced once idle, at most {within_s:g}s" if replace else "cordoned, kept running")
        return answer

    async def _known(self, model: ModelConfig, version: str) -> DeploymentRouting:
        """The version's routing state, its replica set learnt: a router learns it on its first call.
        A version that does not run, or may be at zero replicas, is not called: that would start one."""
        routing = self.routing(model, version)
        may_be_idle = model.fewest_replicas == 0  # min_replicas 0 and no standby replica
        if not routing.synced and version in self.traffic.view(model).live and not may_be_idle:
            try:
                await asyncio.wait_for(self.servers[model.name][version].ready.remote(), _CALL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - no replica answers: the version lists none
                log.info("model %s version %s: no replica answered while listing replicas", model.name, version)
        return routing

    async def _find(self, model: ModelConfig, replica: str) -> tuple[str, DeploymentRouting]:
        known = []
        for version in model.version_names():
            routing = await self._known(model, version)
            if replica in routing.replicas:
                return version, routing
            known += sorted(routing.replicas)
        raise ApiError(404, f"model {model.name!r} has no running replica {replica!r}; it has: "
                       f"{', '.join(known) or 'none'} (GET /admin/models/{model.name}/replicas)",
                       param="replica", code="replica_not_found")

    async def _cordon(self, deployment: str, replica: str, on: bool, routing: DeploymentRouting,
                      keep_one: bool = False) -> None:
        """`keep_one`: the control actor refuses (LastReplica) to cordon the last routable replica. The call
        is bounded: the model's drains wait for it."""
        try:
            now = await asyncio.wait_for(
                self.traffic.actor().cordon.remote(deployment, replica, on, sorted(routing.replicas), keep_one),
                _CALL_TIMEOUT_S)
        except LastReplica:
            raise
        except Exception as exc:  # noqa: BLE001 - the control actor is restarting or unreachable
            log.warning("deployment %s: could not %s replica %s: %r", deployment, "cordon" if on else "release",
                        replica, exc)
            raise ApiError(503, f"the control actor did not answer ({type(exc).__name__}); retry shortly",
                           code="control_unavailable", headers={"Retry-After": "2"}) from None
        routing.set_cordoned(now)  # this gateway at once; the others at their next read of the state

    @staticmethod
    async def _pinned(method: Any, replica: str, within_s: float | None, not_before_s: float | None) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(method.remote(RouteHint(pin=replica), within_s, not_before_s),
                                          _CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the replica went away meanwhile, or does not answer
            raise ApiError(503, f"replica {replica} did not answer ({type(exc).__name__}); retry, or see whether "
                           "it still runs in the model's replica list", code="replica_unavailable",
                           headers={"Retry-After": "2"}) from None


def _last_replica(model: ModelConfig, version: str, replica: str) -> ApiError:
    where = f"model {model.name!r}" + (f" version {version!r}" if model.versioned else "")
    return ApiError(409, f"replica {replica} is the last routable replica of {where}: draining it leaves "
                    "requests waiting for its replacement to start. Add replicas first, or send "
                    '"force": true', param="replica", code="last_replica")
