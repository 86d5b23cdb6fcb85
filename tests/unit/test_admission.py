"""Admission control arithmetic: who is admitted, what Retry-After a refused request gets."""

from __future__ import annotations

from shunter.ops.admission import DEFAULT_RETRY_AFTER_S, MAX_RETRY_AFTER_S, AdmissionGate
from tests.unit.fake_clock import Clock


def test_admits_up_to_capacity_plus_the_queue_bound_then_refuses():
    gate = AdmissionGate(max_queued=2, clock=Clock())
    assert [gate.try_admit(capacity=3) for _ in range(5)] == [None] * 5
    assert gate.queued(capacity=3) == 2
    assert gate.try_admit(capacity=3) == DEFAULT_RETRY_AFTER_S, "nothing finished yet: the default wait"
    gate.release()
    assert gate.try_admit(capacity=3) is None, "a finished request frees its slot"


def test_a_refusal_never_touches_admitted_requests():
    gate = AdmissionGate(max_queued=0, clock=Clock())
    assert gate.try_admit(capacity=1) is None
    assert gate.try_admit(capacity=1) is not None
    assert gate.admitted == 1


def test_with_no_replica_running_only_the_queue_bound_is_admitted():
    """Scale from zero: requests wait for the first replica, but no more than the bound."""
    gate = AdmissionGate(max_queued=2, clock=Clock())
    assert [gate.try_admit(capacity=0) for _ in range(3)][:2] == [None, None]
    assert gate.admitted == 2


def test_retry_after_follows_how_fast_requests_finish():
    clock = Clock()
    gate = AdmissionGate(max_queued=4, window_s=10, clock=clock)
    for _ in range(6):
        assert gate.try_admit(capacity=2) is None
    for _ in range(2):  # two finished within the window: 0.2 per second
        clock.now += 1
        gate.release()
        gate.try_admit(capacity=2)
    # 4 queued + this request = 5 ahead at 0.2/s
    assert gate.try_admit(capacity=2) == 25
    clock.now += 11
    assert gate.finish_rate() == 0, "finishes age out of the window"
    assert gate.try_admit(capacity=2) == DEFAULT_RETRY_AFTER_S


def test_retry_after_is_bounded():
    clock = Clock()
    gate = AdmissionGate(max_queued=1000, window_s=1000, clock=clock)
    for _ in range(1000):
        gate.try_admit(capacity=0)
    gate.release()
    gate.try_admit(capacity=0)
    assert gate.try_admit(capacity=0) == MAX_RETRY_AFTER_S
    fast = AdmissionGate(max_queued=0, window_s=1, clock=clock)
    fast.try_admit(capacity=1)
    for _ in range(100):
        fast.release()
    fast.try_admit(capacity=1)
    assert fast.try_admit(capacity=1) == 1


def test_release_never_goes_below_zero():
    gate = AdmissionGate(max_queued=1, clock=Clock())
    gate.release()
    assert gate.admitted == 0
