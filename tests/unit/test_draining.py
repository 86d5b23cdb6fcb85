"""Draining: the drain clock per leaving replica, and the timeouts handed to Ray."""

from __future__ import annotations

from shunter.config import RoutingConfig
from shunter.deployments.gateway.draining import RAY_KILL_MARGIN_S, DrainTracker, ray_shutdown_timeout_s
from shunter.routing.state import DeploymentRouting
from tests.unit.fake_clock import Clock


def test_ray_kills_only_after_the_gateway_aborted_the_leftovers():
    assert ray_shutdown_timeout_s(300) == 300 + RAY_KILL_MARGIN_S > 300


def test_a_drain_ends_with_the_last_stream_of_a_leaving_replica():
    clock = Clock(100.0)
    tracker = DrainTracker("m", clock)
    tracker.opened("r1")
    tracker.opened("r1")
    departed = clock.now
    clock.now += 4
    assert tracker.closed("r1", departed) is None, "one stream still runs there"
    clock.now += 3
    assert tracker.closed("r1", departed) == 7
    assert tracker.open == {}


def test_streams_of_a_replica_that_stays_measure_no_drain():
    tracker = DrainTracker("m", Clock(100.0))
    tracker.opened("r1")
    assert tracker.closed("r1", None) is None


def test_routing_state_remembers_when_a_replica_left():
    clock = Clock(100.0)
    state = DeploymentRouting("m", "least_connections", RoutingConfig(), clock=clock)
    state.sync_replicas(["a", "b"])
    assert state.departed_at("a") is None
    clock.now += 5
    state.sync_replicas(["b"])
    assert state.departed_at("a") == 105
    clock.now += 5
    state.sync_replicas(["b", "c"])
    assert state.departed_at("a") == 105, "a later update does not restart its drain clock"
    state.forget("b")
    assert state.departed_at("b") == 110, "a replica that died has left too"
    assert state.departed_at("c") is None
