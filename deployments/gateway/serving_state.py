"""What one gateway replica keeps per model and version while it serves: the routing state it shares
with each version's router (breakers, prefix index, running replicas), the model's admission gate and
drain tracker, and the capacity its share of the replicas gives."""

from __future__ import annotations

import math
from typing import Any

from shunter.config import ModelConfig, ShunterConfig
from shunter.deployments.gateway.admission import AdmissionGate
from shunter.deployments.gateway.draining import DrainTracker
from shunter.deployments.gateway.flow_queue import FlowQueue
from shunter.deployments.gateway.telemetry import replicas_routable
from shunter.deployments.gateway.traffic import LiveVersions
from shunter.errors import ApiError
from shunter.ops import metrics as ops_metrics
from shunter.routing.state import DeploymentRouting, deployment_key, routing_state


class ServingState:
    def __init__(self, config: ShunterConfig, servers: dict[str, dict[str, Any]], traffic: LiveVersions):
        """`servers`: model -> version -> the handle of that version's ModelServer deployment."""
        self.config, self.servers, self.traffic = config, servers, traffic
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
            queue = self._queues[model.name] = FlowQueue(lambda: self.capacity(model), self.config.flow_control.classes,
                                                         running=lambda: self.running_sequences(model))
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
        queue them): this gateway's share."""
        return self._replicas(model) * model.engine.max_num_seqs // self.config.gateway.replicas

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
