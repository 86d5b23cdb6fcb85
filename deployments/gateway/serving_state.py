"""What one gateway replica keeps per model and version while it serves: the routing state it shares
with each version's router (breakers, prefix index, running replicas), the model's admission gate and
drain tracker, and the capacity its share of the replicas gives."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from shunter.config import ModelConfig, ShunterConfig
from shunter.deployments.gateway.draining import DrainTracker
from shunter.deployments.gateway.flow.admission import AdmissionGate
from shunter.deployments.gateway.flow.queue import FlowQueue
from shunter.deployments.gateway.telemetry import replicas_routable
from shunter.deployments.gateway.traffic import LiveVersions
from shunter.errors import ApiError
from shunter.ops import metrics as ops_metrics
from shunter.replica_protocol import EngineLoad
from shunter.routing.state import DeploymentRouting, deployment_key, routing_state

LOAD_FRESH_S = 10.0  # an engine's last reported load counts this long (a replica reports with every request)


class ServingState:
    def __init__(self, config: ShunterConfig, servers: dict[str, dict[str, Any]], traffic: LiveVersions,
                 clock: Callable[[], float] = time.monotonic):
        """`servers`: model -> version -> the handle of that version's ModelServer deployment."""
        self.config, self.servers, self.traffic, self.clock = config, servers, traffic, clock
        self._loads: dict[str, dict[str, tuple[float, EngineLoad]]] = {}  # model -> replica -> (when, load)
        self._routing: dict[str, DeploymentRouting] = {}
        self._gates: dict[str, AdmissionGate] = {}
        self._queues: dict[str, FlowQueue] = {}
        self._drains: dict[str, DrainTracker] = {}
        self._routable: dict[tuple[str, str], int] = {}  # last exported replica counts

    def routing(self, model: ModelConfig, version: str) -> DeploymentRouting:
        """The routing state this process shares with the router of one model version's deployment
        (breakers, prefix index)."""
        handle = self.servers[model.name][version]
        state = self._routing.get(handle.deployment_name)
        if state is None:
            state = self._routing[handle.deployment_name] = routing_state(
                deployment_key(handle.app_name, handle.deployment_name), model.name, model.routing_policy,
                model.routing, version=version)
        return state

    def gate(self, model: ModelConfig) -> AdmissionGate:
        """The model's admission gate: this gateway's share of `admission.max_queued_requests`."""
        gate = self._gates.get(model.name)
        if gate is None:
            bound = math.ceil(model.admission.max_queued_requests / self.config.gateway.replicas)
            gate = self._gates[model.name] = AdmissionGate(bound)
        return gate

    def dispatch(self, model: ModelConfig) -> FlowQueue:
        """The model's flow queue: admitted requests go to the replicas as slots free, by priority class and
        fair share between tenants."""
        queue = self._queues.get(model.name)
        if queue is None:
            flow = self.config.flow_control
            queue = self._queues[model.name] = FlowQueue(lambda: self.capacity(model), flow.classes,
                                                         running=lambda: self.running_sequences(model),
                                                         hold_s=flow.headroom_hold_s,
                                                         tenant_headroom=flow.tenant_headroom)
        return queue

    def backlog(self) -> tuple[dict[str, int], dict[str, int]]:
        """Per model, the admitted requests waiting in this gateway for a replica slot; and per model, the
        admitted requests of the batch classes (less urgent than the default class), waiting or running,
        which the autoscaling policy lets start at most `autoscaling.batch_max_replicas`."""
        below = self.config.flow_control.rank(self.config.flow_control.default_class)
        return ({name: queue.depth for name, queue in self._queues.items()},
                {name: gate.admitted_below(below) for name, gate in self._gates.items()})

    def drains(self, model: ModelConfig) -> DrainTracker:
        tracker = self._drains.get(model.name)
        if tracker is None:
            tracker = self._drains[model.name] = DrainTracker(model.name)
        return tracker

    def capacity(self, model: ModelConfig) -> int:
        """Requests the running replicas of the model's serving versions take at once: this gateway's
        share. Until a router has reported a version's running replicas (the first requests after a
        gateway starts), the configured count stands in for them."""
        return self._replicas(model) * model.max_ongoing_requests // self.config.gateway.replicas

    def running_sequences(self, model: ModelConfig) -> int:
        """Sequences the engines of those replicas run at once (`engine.max_num_seqs` each; past it they
        queue them): this gateway's share. Saturation from the engines (issue 52, item 6): an engine that
        reported, within `LOAD_FRESH_S`, requests queued while it ran fewer than `max_num_seqs` is bound by
        its KV cache, and counts what it ran then (at least one) instead of `max_num_seqs`, so a class's
        headroom is kept in what the engine really runs: counted in `max_num_seqs`, a less urgent class
        could fill every sequence a KV-bound engine runs, and an urgent arrival would queue inside it."""
        most, replicas = model.engine.max_num_seqs, self._replicas(model)
        now, short = self.clock(), 0
        loads = self._loads.get(model.name, {})
        for replica, (at, load) in list(loads.items()):
            if now - at > LOAD_FRESH_S:
                del loads[replica]  # stale, or a replica gone
            elif load.waiting and load.running < most:
                short += most - max(1, load.running)
        return max(0, replicas * most - short) // self.config.gateway.replicas

    def engine_reported(self, model: ModelConfig, replica: str, load: EngineLoad) -> None:
        """What a replica's engine reported as it accepted a request (`Accepted.load`)."""
        self._loads.setdefault(model.name, {})[replica] = (self.clock(), load)

    def _replicas(self, model: ModelConfig) -> int:
        replicas = 0
        for version in self.traffic.serving(model):
            routing = self.routing(model, version)
            if routing.synced:
                routable = routing.routable()  # warm standby replicas take nothing while another can
                replicas += routable
                if self._routable.get((model.name, version)) != routable:
                    self._routable[(model.name, version)] = routable
                    replicas_routable(model.name, version, routable)
            else:
                replicas += model.autoscaling.min_replicas if model.autoscaling else model.replicas
        return replicas

    @staticmethod
    def scaled_to_zero(model: ModelConfig, routing: DeploymentRouting) -> bool:
        """The model may scale to zero (min_replicas 0 and no standby replica kept warm) and this gateway
        knows of no running replica."""
        return model.fewest_replicas == 0 and not routing.replicas


def all_replicas_out(model: ModelConfig, routing: DeploymentRouting) -> ApiError:
    """503 when every replica's breaker is open, with how long until one is tried again."""
    ops_metrics.rejection(model.name, "replicas_unavailable")
    wait = routing.unavailable_for_s() or 1.0
    return ApiError(503, f"every replica of model {model.name!r} is failing and temporarily out of service; "
                    "retry shortly", code="replicas_unavailable", headers={"Retry-After": str(max(1, math.ceil(wait)))})
