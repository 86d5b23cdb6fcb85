"""Admission control arithmetic: who is admitted, what Retry-After a refused request gets."""

from __future__ import annotations

import pytest

from shunter.deployments.gateway.admission import (
    DEFAULT_RETRY_AFTER_S,
    MAX_RETRY_AFTER_S,
    AdmissionGate,
)
from tests.unit.fake_clock import Clock


def test_admits_up_to_capacity_plus_the_queue_bound_then_refuses():
    gate = AdmissionGate(max_queued=2, clock=Clock())
    assert [gate.try_admit(capacity=3) for _ in range(5)] == [None] * 5
    assert gate.queued(capacity=3) == 2
    assert gate.try_admit(capacity=3) == DEFAULT_RETRY_AFTER_S, "nothing finished yet: the default wait"
    gate.release()
    assert gate.try_admit(capacity=3) is None, "a finished request frees its slot"


def test_a_batch_counts_as_its_engine_requests_and_a_huge_one_as_the_whole_bound():
    gate = AdmissionGate(max_queued=2, clock=Clock())  # bound: 4 + 2
    assert gate.try_admit(capacity=4, weight=4) is None
    assert gate.admitted == 4
    assert gate.try_admit(capacity=4, weight=3) is not None, "4 + 3 engine requests exceed the bound of 6"
    assert gate.try_admit(capacity=4, weight=2) is None
    gate.release(4), gate.release(2)
    assert gate.admitted == 0
    assert gate.admitted_weight(4, 2100) == 6, "a batch past the whole bound counts as the bound"
    assert gate.try_admit(capacity=4, weight=2100) is None, "an idle model still takes it, alone"
    assert gate.try_admit(capacity=4) is not None, "and nothing else while it runs"
    gate.release(gate.admitted_weight(4, 2100))
    assert gate.admitted == 0 and gate.try_admit(capacity=4) is None


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


def test_a_request_expected_to_wait_past_its_budget_is_refused_below_the_count_bound():
    clock = Clock()
    gate = AdmissionGate(max_queued=100, clock=clock)
    assert [gate.try_admit(capacity=2, max_wait_s=10) for _ in range(2)] == [None, None], "room: no wait"
    assert gate.try_admit(capacity=2, max_wait_s=10) is None, "no finish rate yet: the count alone decides"
    assert gate.expected_wait_s(capacity=2) is None
    for _ in range(8):  # 8 finishes over 8 s: 1 a second
        clock.now += 1
        gate.release()
        assert gate.try_admit(capacity=2) is None  # refilled at once
    assert gate.queued(capacity=2) == 1
    assert gate.expected_wait_s(capacity=2) == pytest.approx((1 + 1) / (8 / 7))
    admitted = 0
    while gate.try_admit(capacity=2, max_wait_s=10) is None:
        admitted += 1
    # about 10 s of waiting at 8 finishes in 7 s: 11 ahead, then the next is past the budget
    assert admitted == 10 and gate.queued(capacity=2) == 11
    assert gate.try_admit(capacity=2) is None, "without a budget the count bound alone applies"


def test_the_bound_counts_a_class_and_the_more_urgent_ones_so_a_batch_backlog_never_refuses_urgent_work():
    gate = AdmissionGate(max_queued=2, clock=Clock())  # bound: 2 + 2
    assert [gate.try_admit(capacity=2, rank=2) for _ in range(4)] == [None] * 4
    assert gate.try_admit(capacity=2, rank=2) is not None, "batch: its own bound is full"
    assert [gate.try_admit(capacity=2, rank=0) for _ in range(4)] == [None] * 4, "interactive: counts only its own"
    assert gate.try_admit(capacity=2, rank=1) is not None, "standard: interactive's 4 fill its bound"
    assert gate.admitted == 8 and gate.admitted_through(1) == 4
    gate.release(1, rank=0)
    assert gate.try_admit(capacity=2, rank=1) is None
    assert gate.admitted_through(0) == 3 and gate.admitted_through(2) == 8


def test_the_wait_and_retry_after_follow_the_slots_its_class_needs():
    clock = Clock()
    gate = AdmissionGate(max_queued=100, clock=clock)
    for _ in range(8):  # 8 finishes over 8 s: 8 / 7 a second
        clock.now += 1
        gate.try_admit(capacity=50)
        gate.release()
    assert gate.expected_wait_s(capacity=50, slots_needed=0) == 0
    assert gate.expected_wait_s(capacity=50, slots_needed=8) == pytest.approx(7)
    assert gate.try_admit(capacity=50, max_wait_s=5, slots_needed=8) == 7, "refused: 7 s of waiting, retry then"
    assert gate.try_admit(capacity=50, max_wait_s=10, slots_needed=8) is None
