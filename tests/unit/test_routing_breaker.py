"""Circuit breakers per replica: the state machine on a fake clock, and the board of one deployment."""

from __future__ import annotations

import pytest

from shunter.config import BreakerConfig
from shunter.routing.breaker import BreakerBoard, BreakerState, CircuitBreaker

CLOSED, HALF_OPEN, OPEN = BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _breaker(**config) -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    settings = {"consecutive_failures": 3, "min_requests": 100, "cooldown_s": 10.0, **config}
    return CircuitBreaker(BreakerConfig(**settings), clock), clock


def _open(breaker: CircuitBreaker) -> None:
    for _ in range(breaker.config.consecutive_failures):
        breaker.record(True, "boom")
    assert breaker.state is OPEN


# ---- CircuitBreaker -------------------------------------------------------------------------------


def test_opens_after_n_consecutive_failures():
    breaker, _ = _breaker()
    assert breaker.record(True) is None and breaker.record(True) is None
    assert breaker.state is CLOSED and breaker.allows()
    assert breaker.record(True, "engine error") == (CLOSED, OPEN)
    assert breaker.state is OPEN and not breaker.allows()
    assert "3 failures in a row" in breaker.last_reason and "engine error" in breaker.last_reason


def test_a_success_resets_the_failure_streak():
    breaker, _ = _breaker()
    for failed in (True, True, False, True, True):
        breaker.record(failed)
    assert breaker.state is CLOSED
    breaker.record(True)
    assert breaker.state is OPEN


def test_error_rate_opens_only_with_enough_outcomes_in_the_window():
    breaker, _ = _breaker(consecutive_failures=100, error_rate=0.5, min_requests=4, window_s=10)
    for failed in (True, False, True):  # 2/3 failed, but only 3 outcomes
        breaker.record(failed)
    assert breaker.state is CLOSED
    breaker.record(False)  # 2/4: a success never opens
    assert breaker.state is CLOSED
    assert breaker.record(True) == (CLOSED, OPEN)  # 3/5
    assert "3/5 failed" in breaker.last_reason


def test_error_rate_below_threshold_stays_closed():
    breaker, _ = _breaker(consecutive_failures=100, error_rate=0.5, min_requests=4)
    for failed in (False, False, True, False, False, True, False):  # 2/7
        breaker.record(failed)
    assert breaker.state is CLOSED


def test_outcomes_older_than_the_window_are_forgotten():
    breaker, clock = _breaker(consecutive_failures=100, error_rate=0.5, min_requests=4, window_s=10)
    for failed in (True, False, True):
        breaker.record(failed)
    clock.now += 10.5
    breaker.record(True)  # would be 3/4 with the old outcomes; alone it is 1 outcome
    assert breaker.state is CLOSED
    for _ in range(3):
        breaker.record(True)
    assert breaker.state is OPEN  # 4/4 inside the window


def test_open_becomes_half_open_after_cooldown():
    breaker, clock = _breaker(cooldown_s=10)
    _open(breaker)
    clock.now += 9.9
    assert breaker.state is OPEN and not breaker.allows()
    clock.now += 0.1
    assert breaker.state is HALF_OPEN and breaker.allows()
    assert breaker.last_reason == "cooldown elapsed"


def test_retry_after_counts_down_to_zero():
    breaker, clock = _breaker(cooldown_s=10)
    assert breaker.retry_after_s() == 0.0
    _open(breaker)
    assert breaker.retry_after_s() == pytest.approx(10)
    clock.now += 4
    assert breaker.retry_after_s() == pytest.approx(6)
    clock.now += 6
    assert breaker.retry_after_s() == 0.0  # half-open now


def test_half_open_lets_only_the_configured_probes_through_at_once():
    breaker, clock = _breaker(half_open_probes=2)
    _open(breaker)
    clock.now += 10
    breaker.on_dispatch()
    assert breaker.allows()
    breaker.on_dispatch()
    assert not breaker.allows() and breaker.state is HALF_OPEN
    breaker.on_probe_done()
    assert breaker.allows()
    breaker.on_dispatch()
    assert not breaker.allows()


def test_probe_success_closes():
    breaker, clock = _breaker()
    _open(breaker)
    clock.now += 10
    breaker.on_dispatch()
    assert breaker.record(False) == (HALF_OPEN, CLOSED)
    assert breaker.state is CLOSED and breaker.allows()
    breaker.record(True)
    breaker.record(True)
    assert breaker.state is CLOSED  # the streak started over when it closed


def test_probe_failure_reopens_with_a_new_cooldown():
    breaker, clock = _breaker(cooldown_s=10)
    _open(breaker)
    clock.now += 15
    breaker.on_dispatch()
    assert breaker.record(True, "still broken") == (HALF_OPEN, OPEN)
    assert breaker.state is OPEN and not breaker.allows()
    assert "probe failed" in breaker.last_reason
    assert breaker.retry_after_s() == pytest.approx(10)
    clock.now += 10
    assert breaker.state is HALF_OPEN and breaker.allows()  # the probe slot was given back


# ---- BreakerBoard ---------------------------------------------------------------------------------


def _board(**config) -> tuple[BreakerBoard, FakeClock, list]:
    clock, changes = FakeClock(), []
    settings = {"consecutive_failures": 2, "min_requests": 100, "cooldown_s": 10.0, **config}
    board = BreakerBoard(BreakerConfig(**settings), clock,
                         on_transition=lambda r, a, b, why: changes.append((r, a, b)))
    return board, clock, changes


def test_board_reports_each_transition_once():
    board, clock, changes = _board()
    board.record("r1", True)
    board.record("r1", True)
    board.record("r1", True)  # still open: no new change
    assert not board.allows("r1") and not board.allows("r1")
    assert changes == [("r1", CLOSED, OPEN)]
    clock.now += 10
    assert board.allows("r1") and board.allows("r1")
    assert changes[1:] == [("r1", OPEN, HALF_OPEN)]
    board.on_dispatch("r1")
    board.record("r1", False)
    board.on_probe_done("r1")
    assert changes[2:] == [("r1", HALF_OPEN, CLOSED)]
    assert len(changes) == 3


def test_board_reports_a_cooldown_first_seen_by_state():
    board, clock, changes = _board()
    board.record("r1", True)
    board.record("r1", True)
    clock.now += 10
    assert board.state("r1") is HALF_OPEN  # read without a callback
    board.allows("r1")
    assert changes == [("r1", CLOSED, OPEN), ("r1", OPEN, HALF_OPEN)]


def test_board_keeps_replicas_apart():
    board, _, _ = _board()
    board.record("r1", True)
    board.record("r1", True)
    assert not board.allows("r1") and board.allows("r2")
    assert board.state("r1") is OPEN and board.state("r2") is CLOSED


def test_all_open_is_none_while_any_replica_may_serve():
    board, clock, _ = _board(cooldown_s=10)
    assert board.all_open([]) is None
    for replica in ("r1", "r2"):
        board.record(replica, True)
        board.record(replica, True)
        clock.now += 3  # r1 opened 3 s before r2
    assert board.all_open(["r1", "r2", "r3"]) is None  # r3 is unknown: it may serve
    assert board.all_open(["r1", "r2"]) == pytest.approx(4)  # r1 probes in 10 - 6 s
    clock.now += 4
    assert board.all_open(["r1", "r2"]) is None  # r1 half-open


def test_all_open_counts_a_half_open_replica_with_its_probes_out_as_blocked():
    board, clock, _ = _board(cooldown_s=10)
    board.record("r1", True)
    board.record("r1", True)
    clock.now += 10
    board.allows("r1")
    board.on_dispatch("r1")
    assert board.all_open(["r1"]) == 0.0
    board.on_probe_done("r1")
    assert board.all_open(["r1"]) is None


def test_retain_forgets_departed_replicas():
    board, _, _ = _board()
    board.record("r1", True)
    board.record("r1", True)
    board.retain(["r2"])
    assert board.state("r1") is CLOSED
    assert board.allows("r1")  # a replacement with the same id starts closed


def test_transitions_carry_state_and_reason():
    reasons = []
    board = BreakerBoard(BreakerConfig(consecutive_failures=2, min_requests=100), FakeClock(),
                         on_transition=lambda r, a, b, why: reasons.append((r, b, why)))
    board.record("r1", True)
    board.record("r1", True, "died")
    board.record("r2", False)
    (replica, state, why), = reasons
    assert replica == "r1" and state is OPEN and "died" in why
    assert board.state("r2") is CLOSED


def test_disabled_breakers_always_allow():
    board, _, changes = _board(enabled=False)
    for _ in range(10):
        board.record("r1", True)
    board.on_dispatch("r1")
    assert board.allows("r1") and board.state("r1") is CLOSED
    assert board.all_open(["r1"]) is None and changes == []


def test_board_reports_a_reopen_by_an_outcome_after_the_cooldown():
    board, clock, changes = _board()
    board.record("r1", True)
    board.record("r1", True)
    clock.now += 10
    board.record("r1", True, "late failure")  # the breaker takes it as a failed probe and reopens
    assert board.state("r1") is OPEN
    assert changes == [("r1", CLOSED, OPEN), ("r1", OPEN, HALF_OPEN), ("r1", HALF_OPEN, OPEN)]
