"""Admission control arithmetic: who is admitted, what Retry-After a refused request gets."""

from __future__ import annotations

import math

import pytest

from shunter.deployments.gateway.flow.admission import (
    DEFAULT_RETRY_AFTER_S,
    MAX_RETRY_AFTER_S,
    AdmissionGate,
    Asker,
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


def _saturated(clock: Clock, rank_rates: dict[int, int], seconds: int = 8) -> AdmissionGate:
    """A gate whose classes finished `rank_rates[rank]` requests a second for `seconds` seconds."""
    gate = AdmissionGate(max_queued=4, clock=clock)
    for _ in range(seconds):
        clock.now += 1
        for rank, per_s in rank_rates.items():
            for _ in range(per_s):
                gate.try_admit(capacity=100, rank=rank)
                gate.release(rank=rank)
    return gate


def test_a_class_is_told_the_rate_its_own_and_less_urgent_slots_free_not_every_class():
    clock = Clock()
    gate = _saturated(clock, {0: 9, 2: 1})  # interactive finishes 9 a second, batch 1
    # 8 batch finishes from t=1 to t=8: 8 per 7 s; the interactive ones do not free slots for batch work
    assert gate.expected_wait_s(capacity=100, rank=2, slots_needed=8) == pytest.approx(7)
    assert gate.expected_wait_s(capacity=100, rank=0, slots_needed=8) == pytest.approx(8 / (80 / 7))
    assert gate.retry_after_s(8, rank=2) == 7
    quiet = _saturated(Clock(), {0: 9, 2: 0})
    assert quiet.expected_wait_s(capacity=100, rank=2, slots_needed=8) is None, \
        "no batch finishes to go by: no wait is known, so none refuses a burst of batch work"
    assert quiet.try_admit(capacity=100, max_wait_s=0.1, rank=2, slots_needed=8) is None
    assert quiet.retry_after_s(8, rank=2) == math.ceil(8 / (72 / 7)), "a Retry-After goes by every class's rate"


def _full(clock: Clock) -> AdmissionGate:
    """Bound 2 + 4, full, 1 finish a second measured."""
    gate = AdmissionGate(max_queued=4, clock=clock)
    for _ in range(8):
        clock.now += 1
        gate.try_admit(capacity=2)
        gate.release()
    while gate.try_admit(capacity=2) is None:
        pass
    assert gate.admitted == 6
    return gate


def test_a_refused_request_keeps_its_place_and_its_retry_gets_in_when_told():
    clock = Clock()
    gate = _full(clock)
    told = gate.try_admit(capacity=2, retry_key=("a", b"body"))
    assert told == 5, "4 queued + this one, at 8 finishes in 7 s"
    assert len(gate.places) == 1
    clock.now += told
    for _ in range(5):  # meanwhile 5 finished; arrivals without a place may not take the place kept
        gate.release()
    assert gate.admitted == 1 and gate.places.kept_through(0) == 1
    assert [gate.try_admit(capacity=2, slots_needed=1) for _ in range(4)] == [None] * 4
    assert gate.try_admit(capacity=2, slots_needed=1, retry_key=("b", b"body")) is not None, \
        "the fifth would take the kept place: refused"
    assert gate.try_admit(capacity=2, slots_needed=1, retry_key=("a", b"body")) is None, "the retry takes it"
    assert len(gate.places) == 1 and gate.admitted == 6, "b's refusal kept b a place; a's is used"


def test_a_place_is_taken_only_when_due_so_the_same_body_sent_again_meanwhile_is_a_new_request():
    clock = Clock()
    gate = _full(clock)
    assert gate.try_admit(capacity=2, retry_key=("a", b"body")) == 5
    clock.now += 2
    gate.release(3)  # three finished: room for a new request, and the place kept stays ahead of it
    assert gate.try_admit(capacity=2, slots_needed=1, retry_key=("a", b"body")) is None, \
        "not due: the same body is another request, admitted as any new one would be"
    assert len(gate.places) == 1
    gate.try_admit(capacity=2, slots_needed=1)
    assert gate.try_admit(capacity=2, slots_needed=1, retry_key=("a", b"body")) is not None, "the bound is full"
    assert len(gate.places) == 2
    clock.now += 2  # within a second of due: Retry-After is rounded up to whole seconds
    assert gate.try_admit(capacity=2, retry_key=("a", b"body")) is None, "the first place is due: taken"
    assert len(gate.places) == 1


def test_a_place_not_taken_lapses_and_the_same_request_is_then_new():
    clock = Clock()
    gate = _full(clock)
    assert gate.try_admit(capacity=2, retry_key=("a", b"body")) == 5
    clock.now += 5 + 2.5  # due, then its grace (half the wait told) run out
    assert len(gate.places) == 1
    clock.now += 0.1
    assert len(gate.places) == 0 and gate.places.kept_through(0) == 0
    assert gate.try_admit(capacity=2, retry_key=("a", b"body")) is not None, "the queue is still full"


def test_places_are_kept_per_class_and_never_hold_back_a_request_that_can_start_at_once():
    clock = Clock()
    gate = _full(clock)
    assert gate.try_admit(capacity=2, rank=2, retry_key=("batch", b"x")) is not None
    assert gate.places.kept_through(2) == 1 and gate.places.kept_through(0) == 0, \
        "a batch place is not ahead of interactive work"
    gate.release(6)
    assert gate.try_admit(capacity=2, rank=2, slots_needed=0) is None, "a free slot is never left for a place"


def test_a_wait_past_the_longest_retry_after_keeps_no_place():
    clock = Clock()
    gate = AdmissionGate(max_queued=1000, window_s=1000, clock=clock)
    for _ in range(8):
        clock.now += 10
        gate.try_admit(capacity=1)
        gate.release()
    assert gate.retry_after_s(100, retry_key=("a", b"x")) == MAX_RETRY_AFTER_S
    assert len(gate.places) == 0, "nothing is promised beyond the longest Retry-After"


def test_the_places_kept_are_bounded():
    from shunter.deployments.gateway.flow.retry_places import RetryPlaces

    places = RetryPlaces(Clock(), max_places=3, per_owner=2)
    assert [places.keep(("a", i), 0, 1, 5.0) for i in range(3)] == [True, True, False], "a's own bound"
    assert places.keep(("b", 0), 0, 1, 5.0) and not places.keep(("c", 0), 0, 1, 5.0), "the gate's bound"
    assert len(places) == 3 and places.kept_through(0) == 3
    places.take(places.find(("a", 0), 0))
    assert len(places) == 2 and places.keep(("a", 3), 0, 1, 5.0)


def test_a_caller_that_never_retries_keeps_no_more_places_than_the_queue_bound():
    clock = Clock()
    gate = _full(clock)  # queue bound 4
    told = [gate.try_admit(capacity=2, retry_key=("hostile", f"body {i}".encode())) for i in range(10)]
    assert all(t is not None for t in told) and len(gate.places) == 4
    assert gate.try_admit(capacity=2, retry_key=("other", b"x")) is not None
    assert len(gate.places) == 5, "another caller still gets its place"


def test_asking_whether_a_request_would_be_refused_changes_nothing_and_agrees_with_admitting_it():
    """The door asks the gate before it parses a body (issue 39): the answer is `try_admit`'s verdict, and
    asking neither admits, nor keeps a place, nor takes one."""
    clock = Clock()
    gate = AdmissionGate(max_queued=2, clock=clock)
    for _ in range(10):  # a finish rate to keep places by
        assert gate.try_admit(1) is None
        clock.now += 0.5
        gate.release()
    for _ in range(3):
        assert not gate.refuses(1, rank=0)
        assert gate.try_admit(1) is None
    assert gate.admitted == 3
    assert gate.refuses(1, rank=0, retry_key=("k", b"d"))
    assert gate.admitted == 3 and gate.places.kept_through(0) == 0, "asking kept no place"
    retry = gate.try_admit(1, retry_key=("k", b"d"))
    assert retry is not None and gate.places.kept_through(0) == 1
    gate.release()
    clock.now += retry
    assert not gate.refuses(1, retry_key=("k", b"d")), "its retry, when due, is admitted on its place"
    assert gate.places.kept_through(0) == 1, "and asking did not take the place"
    assert gate.try_admit(1, retry_key=("k", b"d")) is None and gate.places.kept_through(0) == 0


# ---- fair at the door (issue 52, item 1): each tenant's part of its class's bound ------------------------


def _fill(gate: AdmissionGate, capacity: int, tenant: str, rank: int = 0, share: float = 1.0) -> int:
    """Admit `tenant`'s requests until one is refused; how many got in."""
    admitted = 0
    while gate.try_admit(capacity, rank=rank, asker=Asker(tenant, share)) is None:
        admitted += 1
    return admitted


def test_a_tenant_under_its_part_is_admitted_when_another_of_its_class_filled_the_bound():
    gate = AdmissionGate(max_queued=6, clock=Clock())  # bound: 2 + 6
    assert _fill(gate, 2, "flood") == 8, "alone in its class, a tenant has the whole bound"
    light = Asker("light")
    assert gate.refuses(2, asker=Asker("flood")) and not gate.refuses(2, asker=light)
    assert [gate.try_admit(2, asker=light) for _ in range(4)] == [None] * 4, "its half of the bound of 8"
    assert gate.try_admit(2, asker=light) is not None, "past its part, the full class refuses it too"
    assert gate.try_admit(2, asker=Asker("flood")) is not None, "the flood stays refused"
    assert gate.admitted == 12, "a full class takes at most its tenants' parts beyond the bound"
    for _ in range(8):
        gate.release(tenant="flood")
    assert gate.try_admit(2, asker=Asker("flood")) is None, "the flood gets in again as its own work ends"


def test_a_tenants_part_follows_its_weight():
    gate = AdmissionGate(max_queued=10, clock=Clock())  # bound: 2 + 10
    assert _fill(gate, 2, "flood") == 12
    assert _fill(gate, 2, "heavy", share=3.0) == 9, "3/4 of the bound of 12"
    assert _fill(gate, 2, "thin", share=0.2) == 1, "a tenant with nothing admitted always gets one in"


def test_a_tenant_alone_in_its_class_is_held_to_the_count_which_a_more_urgent_class_may_fill():
    gate = AdmissionGate(max_queued=2, clock=Clock())  # bound: 2 + 2
    assert _fill(gate, 2, "urgent", rank=0) == 4
    assert gate.try_admit(2, rank=1, asker=Asker("batch")) is not None, \
        "the interactive class holds the whole bound: a standard tenant gets no part of it"


def test_a_refused_flood_is_told_its_own_queue_over_its_own_drain_rate():
    clock = Clock()
    gate = AdmissionGate(max_queued=20, window_s=30, clock=clock)  # bound: 4 + 20
    assert _fill(gate, 4, "flood") == 24
    gate.try_admit(4, asker=Asker("light"))
    for _ in range(10):  # the flood finishes one a second, as does the light tenant
        clock.now += 1
        gate.release(tenant="flood"), gate.release(tenant="light")
        assert gate.try_admit(4, asker=Asker("flood")) is None and gate.try_admit(4, asker=Asker("light")) is None
    # 14 of the flood's requests wait in its class's fair queue and it drains 10 in 9 s: 15 more to go
    retry = gate.try_admit(4, slots_needed=22, asker=Asker("flood", own_waiting=14))
    assert retry == math.ceil(15 / (10 / 9)), retry
    assert gate.try_admit(4, slots_needed=22) == math.ceil(22 / (20 / 9)), "without an asker: the class's rate"


def test_a_tenant_within_its_part_is_still_held_to_its_wait_budget_from_its_own_place_in_the_queue():
    clock = Clock()
    gate = AdmissionGate(max_queued=100, clock=clock)
    assert [gate.try_admit(2, asker=Asker("flood")) for _ in range(40)] == [None] * 40
    for _ in range(8):  # one finish a second
        clock.now += 1
        gate.release(tenant="flood")
        gate.try_admit(2, asker=Asker("flood"))
    light = Asker("light")
    assert gate.try_admit(2, max_wait_s=5, slots_needed=1, asker=light) is None, "at the head: about 1 s"
    assert gate.try_admit(2, max_wait_s=5, slots_needed=30, asker=light) is not None, "30 ahead: past 5 s"
