"""Ray Serve request routers for ModelServer deployments (public `ray.serve.request_router` API; what they
need of Ray's private router internals goes through `shunter.ray_compat`).

Every policy runs behind `ShunterGuard`, which owns what must hold whatever the policy:
- replicas whose circuit breaker is open get no traffic (half-open ones get their probes);
- replicas an operator drains get none while another replica can take it;
- a model's warm standby replicas get none while a serving one can take it (`shunter.ops.standby`);
- a retry avoids the replica it failed on; a pinned call (stats, drain) goes to its replica only;
- the shared per-process state (prefix index, breakers, in-flight counts) follows the replica set,
  and a replica that leaves or dies is forgotten at once.

Policies:
- `PrefixAwareRouter` ranks by the cost model in `shunter.routing.policy` (cached prefix and held LoRA
  adapter vs load);
- `LeastConnectionsRouter` ranks by requests in flight;
- `PowerOfTwoRouter` is Ray Serve's default policy behind the guard;
- any other Ray RequestRouter runs behind the guard too (policy `custom`, see `shunter.routing.custom`).

Load is the larger of two counts: this process's own (requests it has in flight on the replica, plus
those a router just chose it for and is still sending: a burst is routed concurrently, so a choice must
count before Ray reports the send), and Ray's queue-length cache (what the replica reported with its
last answer, plus what that router sent since), which also sees other gateway replicas' traffic.
Nothing here makes a remote call; Ray's base class probes a replica's queue length only when its cached
entry has gone stale (no traffic for 10 s) or the replica reported itself full.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from shunter import ray_compat
from shunter.config import DEFAULT_VERSION, RoutingConfig
from shunter.replica_protocol import ReplicaRequest, find_hint
from shunter.routing import metrics
from shunter.routing.policy import (
    LEAST_LOADED,
    LOAD_FALLBACK,
    PREFIX_HIT,
    Candidate,
    rank_least_connections,
    rank_prefix_aware,
)
from shunter.routing.prefix import prefix_key, render_prompt
from shunter.routing.state import DeploymentRouting, deployment_key, routing_state

log = logging.getLogger("ray.serve")

BREAKER_SKIP = "breaker_skip"
RETRY = "retry"


class ShunterGuard:
    """Mixin placed before a RequestRouter class in the MRO; see the module docstring."""

    _shunter: DeploymentRouting
    policy_name = "custom"

    def initialize_state(self, shunter: dict[str, Any] | None = None, **kwargs: Any) -> None:
        spec = shunter or {}
        app_name, deployment = ray_compat.router_deployment(self)
        self._shunter = routing_state(
            deployment_key(app_name, deployment),
            model=spec.get("model", deployment),
            version=spec.get("version", DEFAULT_VERSION),
            policy=spec.get("policy", self.policy_name),
            config=RoutingConfig.model_validate(spec.get("routing", {})),
            block_size=spec.get("block_size"),
        )
        self._rng = random.Random()
        super().initialize_state(**kwargs)  # type: ignore[misc]

    # ---- candidate filtering ------------------------------------------------------------------

    def _guard(self, candidates: list[RunningReplica], pending: PendingRequest | None) -> list[RunningReplica]:
        hint = find_hint(pending.args, pending.kwargs) if pending is not None else None
        if hint is not None and hint.pin:
            return [c for c in candidates if c.replica_id.unique_id == hint.pin]
        allowed = [c for c in candidates if self._shunter.allows(c.replica_id.unique_id)]
        if pending is not None and len(allowed) < len(candidates):
            ray_compat.set_request_note(pending, "skipped", True)  # counted once, when the request is routed
        cordoned = self._shunter.cordoned
        if cordoned:  # a drained replica serves only when no other one can: nothing is refused for it
            allowed = [c for c in allowed if c.replica_id.unique_id not in cordoned] or allowed
        if hint is not None and hint.avoid:
            others = [c for c in allowed if c.replica_id.unique_id not in hint.avoid]
            allowed = others or allowed  # the only replica left may still serve a retry
        serving = self._shunter.serving
        if serving is not None:  # standby replicas take requests only when no serving one can
            allowed = [c for c in allowed if c.replica_id.unique_id in serving] or allowed
        return allowed

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        allowed = self._guard(candidate_replicas, pending_request)
        if not allowed:
            return []
        ranked = await super().choose_replicas(allowed, pending_request)  # type: ignore[misc]
        # Some policies (Ray's own) draw from their full replica set, not the candidates given: filter.
        ok = {r.replica_id for r in allowed}
        groups = [[r for r in group if r.replica_id in ok] for group in ranked]
        groups = [g for g in groups if g]
        return groups or [self._rng.sample(allowed, min(2, len(allowed)))]

    # ---- lifecycle hooks ----------------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)  # type: ignore[misc]
        self._shunter.sync_replicas(
            [r.replica_id.unique_id for r in replicas],
            {r.replica_id.unique_id: (r.routing_stats or {}) for r in replicas},
        )

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)  # type: ignore[misc]
        self._shunter.forget(replica_id.unique_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)  # type: ignore[misc]
        replica, state = replica_id.unique_id, self._shunter
        hint = find_hint(pending_request.args, pending_request.kwargs)
        # Keyed by the caller's request id when it sent one: the gateway reports the first byte by it.
        request_id = (hint.request_id if hint is not None and hint.request_id
                      else pending_request.metadata.internal_request_id)
        state.unreserve(pending_request.metadata.internal_request_id)
        if ray_compat.request_note(pending_request, "skipped", False):
            metrics.decision(state.model, state.version, state.policy, BREAKER_SKIP)
        if hint is not None and hint.avoid:
            metrics.decision(state.model, state.version, state.policy, RETRY)
        if not isinstance(hint, ReplicaRequest):
            self._count_until_done(replica, request_id, result)
            return
        key = ray_compat.request_note(pending_request, "key")
        if key is None:
            key = prefix_key(render_prompt(hint.endpoint, hint.body), state.block_size)
        matched = state.matched(replica, key.keys)
        adapter = _adapter_of(hint, state)
        # A load the replica must do first stalls it like that much more prefill (routing.adapter_load_tokens).
        load = 0 if adapter is None or state.holds_adapter(replica, adapter) else state.config.adapter_load_tokens
        self._count_until_done(replica, request_id, result, prefill_tokens=key.uncached_tokens(matched) + load,
                               adapter=adapter)
        if key.chars:
            share = min(1.0, matched * key.chunk_chars / key.chars)
            metrics.prefix_match(state.model, state.version, share)
            state.predicted(request_id, replica, share)
        reason = self._reason(pending_request, replica, matched)
        if reason:
            metrics.decision(state.model, state.version, state.policy, reason)
        state.record_prefix(replica, key.keys)
        if adapter is not None:
            state.record_adapter(replica, adapter)

    def _count_until_done(self, replica: str, request_id: str, result: Any, prefill_tokens: int = 0,
                          adapter: str | None = None) -> None:
        """Count the request in flight on `replica` until its call ends. Ray's on_request_completed cannot
        end it: Ray registers that callback before the replica accepts the call and reports the routing
        only after, so a short call (a stats probe, a whole 8-token stream) can complete first, and a count
        taken then would stay for good. A callback added now runs after the count, at once if the call
        already ended. (The gateway also ends its requests itself: DeploymentRouting.finished.)"""
        state = self._shunter
        state.dispatched(replica, request_id, prefill_tokens, adapter)
        add_done_callback = getattr(result, "add_done_callback", None)
        if add_done_callback is None:  # not a Ray call (nothing would ever report its end): do not count it
            state.completed(replica, request_id)
            return
        add_done_callback(lambda _: state.completed(replica, request_id))

    def _reason(self, pending: PendingRequest, replica: str, matched: int) -> str | None:
        return self.policy_name

    def _load(self, replica: RunningReplica) -> int:
        ours = self._shunter.load(replica.replica_id.unique_id)
        cached = ray_compat.cached_queue_len(self, replica.replica_id)
        return ours if cached is None else max(ours, cached)

    def _reserve(self, pending: PendingRequest | None, order: tuple[str, ...], prefill_tokens: int = 0,
                 adapter: str | None = None) -> None:
        """Count the request on its first-ranked replica until Ray reports where it went."""
        if pending is not None and order:
            self._shunter.reserve(pending.metadata.internal_request_id, order[0], prefill_tokens, adapter)

    def _by_least_load(self, allowed: list[RunningReplica],
                       pending: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranked groups of one replica each, fewest requests in flight first."""
        by_id = {r.replica_id.unique_id: r for r in allowed}
        ranking = rank_least_connections([Candidate(i, self._load(r)) for i, r in by_id.items()], self._rng)
        self._reserve(pending, ranking.order)
        return [[by_id[i]] for i in ranking.order]


def _adapter_of(hint: ReplicaRequest, state: DeploymentRouting) -> str | None:
    """The LoRA adapter the request names: the gateway sends the engine's name for it as `model`, which
    is the base model's own name otherwise."""
    name = hint.body.get("model")
    return name if isinstance(name, str) and name != state.model else None


class LeastConnectionsRouter(ShunterGuard, RequestRouter):
    """The replica with the fewest requests in flight; ties broken at random."""

    policy_name = "least_connections"

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        return self._by_least_load(self._guard(candidate_replicas, pending_request), pending_request)

    def _reason(self, pending: PendingRequest, replica: str, matched: int) -> str | None:
        return LEAST_LOADED


class PrefixAwareRouter(ShunterGuard, RequestRouter):
    """Cached prefix against load, by the cost model of `shunter.routing.policy.rank_prefix_aware`."""

    policy_name = "prefix_aware"

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        allowed = self._guard(candidate_replicas, pending_request)
        hint = find_hint(pending_request.args, pending_request.kwargs) if pending_request is not None else None
        if not isinstance(hint, ReplicaRequest):  # ready(), stats(): no prompt to match
            return self._by_least_load(allowed, pending_request)
        by_id = {r.replica_id.unique_id: r for r in allowed}
        state = self._shunter
        key = ray_compat.request_note(pending_request, "key")
        if key is None:  # computed once per request, though Ray may ask again after a rejection
            key = prefix_key(render_prompt(hint.endpoint, hint.body), state.block_size)
            ray_compat.set_request_note(pending_request, "key", key)
        adapter = _adapter_of(hint, state)
        candidates = [Candidate(i, self._load(r), state.matched(i, key.keys), state.pending_prefill(i),
                                has_adapter=adapter is None or state.holds_adapter(i, adapter),
                                adapter_waits=0 if adapter is None else state.adapter_waits(i, adapter))
                      for i, r in by_id.items()]
        ranking = rank_prefix_aware(candidates, key, state.config.load_cost_tokens, state.config.max_load_gap,
                                    self._rng, state.config.adapter_load_tokens, state.config.adapter_busy_tokens)
        most = max((c.matched for c in candidates), default=0)
        ray_compat.set_request_note(pending_request, "most", most)
        if ranking.order:
            first = next(c for c in candidates if c.replica == ranking.order[0])
            load = 0 if first.has_adapter else state.config.adapter_load_tokens
            self._reserve(pending_request, ranking.order, key.uncached_tokens(first.matched) + load, adapter)
        return [[by_id[i]] for i in ranking.order]

    def _reason(self, pending: PendingRequest, replica: str, matched: int) -> str | None:
        most = ray_compat.request_note(pending, "most", matched)
        if most == 0:
            return LEAST_LOADED
        return PREFIX_HIT if matched >= most else LOAD_FALLBACK


class PowerOfTwoRouter(ShunterGuard, ray_compat.power_of_two_router()):  # type: ignore[misc]
    """Ray Serve's default policy (two random replicas, the shorter queue), behind the guard."""

    policy_name = "power_of_two"
