"""StickyGauge: the request path only notes a gauge's value; one thread hands Ray the values set since its
last turn, and every held value now and then (Ray's agent forgets a series it has not heard of)."""

from __future__ import annotations

import pytest

from shunter.ray_metrics import StickyGauge

pytestmark = pytest.mark.unit


class RecordingGauge:
    """Stands in for a `ray.util.metrics.Gauge`: what reached Ray, in order."""

    def __init__(self) -> None:
        self.sets: list[tuple[float, dict[str, str]]] = []

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.sets.append((value, tags))


@pytest.fixture
def gauges(monkeypatch):
    """StickyGauges of their own, with no publishing thread: the test turns the thread's wheel."""
    monkeypatch.setattr(StickyGauge, "_all", [])
    monkeypatch.setattr(StickyGauge, "_refresher", object())

    def make() -> tuple[StickyGauge, RecordingGauge]:
        ray_gauge = RecordingGauge()
        return StickyGauge(ray_gauge), ray_gauge

    return make


def test_a_burst_of_sets_reaches_ray_once_with_the_last_value(gauges):
    sticky, ray_gauge = gauges()
    for count in range(1, 101):
        sticky.set(count, tags={"model": "m"})
    assert ray_gauge.sets == [], "nothing is handed to Ray on the request path"
    StickyGauge.publish(everything=False)
    assert ray_gauge.sets == [(100, {"model": "m"})]
    StickyGauge.publish(everything=False)
    assert ray_gauge.sets == [(100, {"model": "m"})], "an unchanged value waits for the refresh"


def test_the_refresh_sends_every_held_series_and_a_cleared_one_no_more(gauges):
    sticky, ray_gauge = gauges()
    other, other_ray = gauges()
    sticky.set(1, tags={"model": "a", "replica": "r1"})
    sticky.set(2, tags={"model": "a", "replica": "r2"})
    other.set(3, tags={"model": "b"})
    StickyGauge.publish(everything=False)
    sticky.clear(replica="r1")
    ray_gauge.sets.clear()
    other_ray.sets.clear()
    StickyGauge.publish(everything=True)
    assert ray_gauge.sets == [(2, {"model": "a", "replica": "r2"})]
    assert other_ray.sets == [(3, {"model": "b"})]


def test_a_set_then_cleared_before_the_turn_is_never_sent(gauges):
    sticky, ray_gauge = gauges()
    sticky.set(5, tags={"model": "gone"})
    sticky.clear(model="gone")
    StickyGauge.publish(everything=False)
    StickyGauge.publish(everything=True)
    assert ray_gauge.sets == []


def test_a_gauge_that_fails_in_ray_does_not_stop_the_others(gauges):
    class Broken(RecordingGauge):
        def set(self, value, tags):
            raise RuntimeError("the agent is gone")

    StickyGauge(Broken()).set(1, tags={"model": "x"})
    sticky, ray_gauge = gauges()
    sticky.set(2, tags={"model": "y"})
    StickyGauge.publish(everything=False)
    assert ray_gauge.sets == [(2, {"model": "y"})]
