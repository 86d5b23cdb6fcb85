"""A deployment's shared routing state follows its replica set: departed replicas leave nothing behind."""

from __future__ import annotations

import pytest

from shunter.config import BreakerConfig, RoutingConfig
from shunter.routing.prefix import CHARS_PER_TOKEN, prefix_key
from shunter.routing.state import DeploymentRouting, deployment_key, routing_state

KEYS = prefix_key("k" * (8 * 16 * CHARS_PER_TOKEN), 16).keys  # 8 chunks


class FakeClock:
    def __init__(self, now: float = 50.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _state(clock=None, **breaker) -> DeploymentRouting:
    config = RoutingConfig(breaker=BreakerConfig(consecutive_failures=1, cooldown_s=10, **breaker))
    return DeploymentRouting("m", "prefix_aware", config, 16, clock or FakeClock())


def test_sync_replicas_drops_departed_replicas_state():
    state = _state()
    state.sync_replicas(["r1", "r2"])
    for replica in ("r1", "r2"):
        state.record_prefix(replica, KEYS)
        state.dispatched(replica, "q1")
        state.record_outcome(replica, failed=True)
    assert not state.allows("r1") and state.load("r1") == 1 and state.matched("r1", KEYS) == 8
    state.sync_replicas(["r2", "r3"])
    assert state.replicas == {"r2", "r3"}
    assert state.matched("r1", KEYS) == 0 and state.load("r1") == 0 and state.allows("r1")
    assert state.matched("r2", KEYS) == 8 and state.load("r2") == 1 and not state.allows("r2")


def test_capacity_comes_from_reported_kv_cache_blocks():
    state = _state()
    state.record_prefix("r1", KEYS)
    state.sync_replicas(["r1", "r2"], {"r1": {"kv_cache_blocks": 3}, "r2": {}})
    assert state.prefix.capacity("r1") == 3 and state.matched("r1", KEYS) == 3
    assert state.prefix.capacity("r2") == state.prefix.default_capacity
    state.sync_replicas(["r1"], {"r1": {"kv_cache_blocks": 0, "block_size": 32}})  # 0: not reported yet
    assert state.prefix.capacity("r1") == 3 and state.block_size == 32


def test_a_replicas_prefix_report_is_taken_once_and_replaces_belief():
    clock = FakeClock()
    state = _state(clock)
    state.sync_replicas(["r1"])
    state.record_prefix("r1", KEYS)
    clock.now += 60  # long past the speculation window: only a report can say r1 holds anything
    state.sync_replicas(["r1"], {"r1": {"prefix_keys": list(KEYS[:2]), "prefix_exact": True, "prefix_report": 1}})
    assert state.matched("r1", KEYS) == 2 and state.prefix_source("r1") == "precise"
    state.record_prefix("r1", KEYS)  # sent again: counted at once, before any report shows it
    assert state.matched("r1", KEYS) == 8
    clock.now += 60
    state.sync_replicas(["r1"], {"r1": {"prefix_keys": list(KEYS[:2]), "prefix_exact": True, "prefix_report": 1}})
    assert state.matched("r1", KEYS) == 8, "the same report handed again changes nothing"
    state.sync_replicas(["r1"], {"r1": {"prefix_keys": [], "prefix_exact": True, "prefix_report": 2}})
    assert state.matched("r1", KEYS) == 0, "the engine evicted it: the router stops believing it"
    state.sync_replicas(["r1"], {"r1": {"prefix_keys": [], "prefix_exact": False, "prefix_report": 3}})
    assert state.prefix_source("r1") == "approximate", "events were lost: predicted again until exact"


def test_approximate_mode_ignores_prefix_reports():
    config = RoutingConfig(prefix_source="approximate")
    state = DeploymentRouting("m", "prefix_aware", config, 16, FakeClock())
    state.sync_replicas(["r1"], {"r1": {"prefix_keys": list(KEYS), "prefix_exact": True, "prefix_report": 1}})
    assert state.matched("r1", KEYS) == 0 and state.prefix_source("r1") == "approximate"


def test_inflight_counts_dispatches_and_completions():
    state = _state()
    state.dispatched("r1", "q2")
    state.dispatched("r1", "q3")
    state.completed("r1", "q2")
    assert state.load("r1") == 1
    state.completed("r1", "q3")
    state.completed("r1", "q3")  # never below zero
    assert state.load("r1") == 0


def test_forget_drops_a_dead_replicas_prefix_and_load():
    state = _state()
    state.sync_replicas(["r1", "r2"])
    state.record_prefix("r1", KEYS)
    state.dispatched("r1", "q4")
    state.forget("r1")
    assert state.replicas == {"r2"} and state.matched("r1", KEYS) == 0 and state.load("r1") == 0


def test_unavailable_for_s_only_when_every_replica_is_blocked():
    clock = FakeClock()
    state = _state(clock)
    assert state.unavailable_for_s() is None  # no replicas known
    state.sync_replicas(["r1", "r2"])
    state.record_outcome("r1", failed=True)
    assert state.unavailable_for_s() is None  # r2 may serve
    clock.now += 4
    state.record_outcome("r2", failed=True)
    assert state.unavailable_for_s() == pytest.approx(6)
    clock.now += 6
    assert state.unavailable_for_s() is None  # r1 half-open: a probe may go


def test_probe_slot_is_taken_by_dispatch_and_freed_by_completion():
    clock = FakeClock()
    state = _state(clock)
    state.sync_replicas(["r1"])
    state.record_outcome("r1", failed=True)
    clock.now += 10
    assert state.allows("r1")
    state.dispatched("r1", "q5")
    assert not state.allows("r1") and state.unavailable_for_s() == 0.0
    state.completed("r1", "q5")
    assert state.allows("r1")


def test_routing_state_is_shared_per_deployment_key(monkeypatch):
    registry: dict = {}
    monkeypatch.setattr("shunter.routing.state._by_deployment", registry)  # leave the process's registry as it was
    key = deployment_key("app", "model-x")
    assert key not in registry
    first = routing_state(key, "x", "least_connections", RoutingConfig())
    assert first.block_size == 16  # the gateway does not know the engine's block size
    second = routing_state(key, "x", "least_connections", RoutingConfig(), block_size=128)
    assert second is first and first.block_size == 128 and registry[key] is first
    routing_state(key, "x", "least_connections", RoutingConfig())  # None keeps what a router set
    assert first.block_size == 128


def test_a_request_from_before_the_open_does_not_free_a_probe_slot():
    clock = FakeClock()
    state = _state(clock)
    state.sync_replicas(["r1"])
    state.dispatched("r1", "old")  # a long request goes out while closed: it holds no probe slot
    state.record_outcome("r1", failed=True)
    clock.now += 10
    assert state.allows("r1")
    state.dispatched("r1", "probe")
    state.completed("r1", "old")  # the old request ends
    assert not state.allows("r1"), "the probe is still in flight"
    state.completed("r1", "probe")
    assert state.allows("r1")


def test_pending_prefill_counts_until_the_first_byte_or_the_end():
    state = _state()
    state.sync_replicas(["r1", "r2"])
    state.dispatched("r1", "a", prefill_tokens=1000)
    state.dispatched("r1", "b", prefill_tokens=300)
    state.dispatched("r2", "c", prefill_tokens=50)
    assert state.pending_prefill("r1") == 1300 and state.pending_prefill("r2") == 50
    state.first_byte("a")
    state.first_byte("a")  # reported twice: counted once
    assert state.pending_prefill("r1") == 300
    state.completed("r1", "b")  # ended (failed, cancelled) before answering
    assert state.pending_prefill("r1") == 0
    state.dispatched("r2", "c", prefill_tokens=70)  # a retry of the same request replaces its entry
    assert state.pending_prefill("r2") == 70
    state.sync_replicas(["r1"])
    assert state.pending_prefill("r2") == 0


def test_a_reservation_counts_until_the_request_is_dispatched():
    """A burst is routed concurrently: a replica chosen for a request still being sent carries it."""
    clock = FakeClock()
    state = _state(clock)
    state.sync_replicas(["r1", "r2"])
    state.reserve("a", "r1", prefill_tokens=100)
    state.reserve("b", "r1", prefill_tokens=50)
    assert state.load("r1") == 2 and state.pending_prefill("r1") == 150 and state.load("r2") == 0
    state.reserve("b", "r2", prefill_tokens=50)  # ranked again after a rejection: it moves
    assert state.load("r1") == 1 and state.load("r2") == 1
    state.unreserve("a")
    state.dispatched("r1", "a", prefill_tokens=100)
    assert state.load("r1") == 1 and state.pending_prefill("r1") == 100, "counted once, not twice"


def test_a_reservation_never_dispatched_expires_and_a_departed_replica_drops_its_own():
    from shunter.routing.state import RESERVATION_TTL_S

    clock = FakeClock()
    state = _state(clock)
    state.sync_replicas(["r1", "r2"])
    state.reserve("gone", "r1")
    state.reserve("r2-bound", "r2")
    clock.now += RESERVATION_TTL_S + 1
    assert state.load("r1") == 0, "a request cancelled while routed does not hold load forever"
    state.reserve("r2-bound", "r2")
    state.sync_replicas(["r1"])
    assert state.load("r2") == 0


def test_the_router_and_the_gateway_both_ending_a_request_count_it_once():
    """Ray does not report every cancelled or failed stream to the router; the gateway ends those."""
    state = _state()
    state.sync_replicas(["r1", "r2"])
    state.dispatched("r1", "q1", prefill_tokens=40)
    state.dispatched("r1", "q2")
    state.finished("q1")  # the gateway stopped relaying q1
    assert state.load("r1") == 1 and state.pending_prefill("r1") == 0
    state.completed("r1", "q1")  # Ray's late report of the same request
    assert state.load("r1") == 1
    state.dispatched("r2", "q2")  # a retry of q2 elsewhere is its own flight
    state.finished("q2")
    assert state.load("r1") == 0 and state.load("r2") == 0


def test_a_request_finished_before_its_route_was_reported_is_never_counted():
    """Ray reports a request routed (on the router's loop) after the replica accepted it; a short stream
    can be relayed whole and finished by the gateway first. Seen on a live app as one request left counted
    in flight for good after six concurrent 8-token streams."""
    clock = FakeClock()
    state = _state(clock)
    state.sync_replicas(["r1"])
    state.finished("q1.1")  # the gateway relayed the whole reply
    state.dispatched("r1", "q1.1", prefill_tokens=40)  # the router's late report
    state.completed("r1", "q1.1")  # and Ray's completion, possibly even before it
    assert state.load("r1") == 0 and state.pending_prefill("r1") == 0
    state.dispatched("r1", "q1.2")  # the gateway's retry is another attempt id: counted
    assert state.load("r1") == 1
    clock.now += 61
    state.finished("q1.2")  # the memory of finished ids is bounded in time
    assert state.load("r1") == 0 and "q1.1" not in state._finished


class _Call:
    """A Ray call's result as the router sees it: done callbacks run at once once it has ended."""

    def __init__(self, done: bool = False):
        self.done, self.callbacks = done, []

    def add_done_callback(self, callback) -> None:
        if self.done:
            callback(None)
        else:
            self.callbacks.append(callback)

    def end(self) -> None:
        self.done = True
        for callback in self.callbacks:
            callback(None)


def test_a_call_that_ended_before_ray_reported_it_routed_is_not_left_in_flight():
    """Ray registers its completion callback before the replica accepts a call and reports the routing
    after: a short call (a stats probe, a whole short stream) can end first. Seen on a live app as one
    request counted in flight for good. The router counts a call until a callback it adds itself."""
    from shunter.routing.routers import LeastConnectionsRouter

    router = object.__new__(LeastConnectionsRouter)  # the bookkeeping alone: no Ray router behind it
    router._shunter = _state()
    router._shunter.sync_replicas(["r1"])
    router._count_until_done("r1", "stats-1", _Call(done=True))
    assert router._shunter.load("r1") == 0
    running = _Call()
    router._count_until_done("r1", "q1.1", running, prefill_tokens=40)
    assert router._shunter.load("r1") == 1 and router._shunter.pending_prefill("r1") == 40
    running.end()
    assert router._shunter.load("r1") == 0 and router._shunter.pending_prefill("r1") == 0
