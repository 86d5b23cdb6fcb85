"""The rollout state machine (ops/rollout.py): every transition, the gates, pause/resume, and resuming
from saved state after a crash. An explicit clock; no cluster."""

from __future__ import annotations

import json

import pytest

from shunter.ops.rollout import (
    Gates,
    Phase,
    RemoveVersion,
    Rollout,
    RolloutSpec,
    SetWeights,
    WindowStats,
    advance,
    evaluate_gates,
    pause,
    percentile,
    resume,
    roll_back,
    start,
)

SPEC = RolloutSpec(model="smol", old="v1", new="v2", steps=(10, 50, 100), hold_s=30, max_hold_s=120,
                   ready_timeout_s=300)
GOOD_OLD = WindowStats(requests=200, errors=0, ttft_p95_s=0.5, e2e_p95_s=2.0)
GOOD_NEW = WindowStats(requests=50, errors=0, ttft_p95_s=0.55, e2e_p95_s=2.1)


def _shifting(step: int = 0, at: float = 100.0) -> Rollout:
    r, _ = start(SPEC, 0.0)
    r, _ = advance(r, at, new_ready=True, new_failed=None)
    for i in range(step):
        r, _ = advance(r, at + 30 * (i + 1), True, None, GOOD_OLD, GOOD_NEW)
    return r


def test_start_deploys_at_weight_zero():
    r, actions = start(SPEC, 0.0)
    assert r.phase is Phase.DEPLOYING and r.weights == {"v1": 100, "v2": 0}
    assert actions == [SetWeights({"v1": 100, "v2": 0})]


def test_ready_enters_the_first_step():
    r, _ = start(SPEC, 0.0)
    r, actions = advance(r, 50.0, new_ready=False, new_failed=None)
    assert r.phase is Phase.DEPLOYING and actions == []
    r, actions = advance(r, 60.0, new_ready=True, new_failed=None)
    assert r.phase is Phase.SHIFTING and r.step == 0 and actions == [SetWeights({"v1": 90, "v2": 10})]


@pytest.mark.parametrize("failed, now", [("engine raised at start", 10.0), (None, 300.0)])
def test_a_new_version_that_never_gets_ready_is_rolled_back(failed, now):
    r, _ = start(SPEC, 0.0)
    r, actions = advance(r, now, new_ready=False, new_failed=failed)
    assert r.phase is Phase.ROLLING_BACK and r.weights == {"v1": 100, "v2": 0}
    assert actions == [SetWeights({"v1": 100, "v2": 0}), RemoveVersion("v2")]
    assert "rolling back" in r.history[-1].reason
    r, _ = advance(r, now + 5, False, None, removed=True)
    assert r.phase is Phase.DONE and r.outcome == "rolled_back"


def test_every_step_holds_then_moves_on_and_the_last_promotes():
    r = _shifting()
    r, actions = advance(r, 110.0, True, None, GOOD_OLD, GOOD_NEW)
    assert actions == [] and r.step == 0, "still inside the hold"
    r, actions = advance(r, 130.0, True, None, GOOD_OLD, GOOD_NEW)
    assert r.step == 1 and actions == [SetWeights({"v1": 50, "v2": 50})]
    assert r.history[-1].gates["new_requests"] == 50
    r, actions = advance(r, 160.0, True, None, GOOD_OLD, GOOD_NEW)
    assert r.step == 2 and actions == [SetWeights({"v1": 0, "v2": 100})]
    r, actions = advance(r, 190.0, True, None, GOOD_OLD, GOOD_NEW)
    assert r.phase is Phase.PROMOTED and actions == [SetWeights({"v1": 0, "v2": 100}), RemoveVersion("v1")]
    r, actions = advance(r, 200.0, True, None, removed=False)
    assert r.phase is Phase.PROMOTED and actions == []
    r, _ = advance(r, 210.0, True, None, removed=True)
    assert r.phase is Phase.DONE and r.outcome == "promoted" and r.weights == {"v1": 0, "v2": 100}
    assert advance(r, 999.0, True, None) == (r, []), "done is final"


def test_one_atomic_switch():
    spec = RolloutSpec(model="m", old="a", new="b", steps=(100,), hold_s=10)
    r, _ = start(spec, 0)
    r, actions = advance(r, 1, True, None)
    assert actions == [SetWeights({"a": 0, "b": 100})]
    r, actions = advance(r, 11, True, None, GOOD_OLD, GOOD_NEW)
    assert r.phase is Phase.PROMOTED and RemoveVersion("a") in actions


def test_errors_roll_back_at_once_without_waiting_for_the_hold():
    r = _shifting()
    bad = WindowStats(requests=4, errors=3)
    r, actions = advance(r, 101.0, True, None, GOOD_OLD, bad)
    assert r.phase is Phase.ROLLING_BACK and actions[0] == SetWeights({"v1": 100, "v2": 0})
    assert "error rate" in r.history[-1].reason and "at 10%" in r.history[-1].reason


@pytest.mark.parametrize("new", [
    WindowStats(requests=50, errors=0, ttft_p95_s=2.0, e2e_p95_s=2.0),
    WindowStats(requests=50, errors=0, ttft_p95_s=0.5, e2e_p95_s=9.0),
])
def test_a_far_slower_version_is_rolled_back(new):
    r = _shifting(step=1)
    r, _ = advance(r, 200.0, True, None, GOOD_OLD, new)
    assert r.phase is Phase.ROLLING_BACK and "p95" in r.history[-1].reason


def test_too_little_traffic_waits_then_rolls_back_at_max_hold():
    r = _shifting()
    few = WindowStats(requests=3, ttft_p95_s=0.5, e2e_p95_s=2.0)
    r, actions = advance(r, 140.0, True, None, GOOD_OLD, few)
    assert r.phase is Phase.SHIFTING and actions == [], "past the hold, but nothing to judge yet"
    r, _ = advance(r, 220.0, True, None, GOOD_OLD, few)
    assert r.phase is Phase.ROLLING_BACK and "could not judge" in r.history[-1].reason


def test_pause_freezes_weights_and_clock_and_resume_continues():
    r = _shifting()
    r = pause(r, 110.0)
    assert r.paused and advance(r, 500.0, True, None, GOOD_OLD, GOOD_NEW) == (r, [])
    r = resume(r, 500.0)
    assert not r.paused and r.step_started_at == 100.0 + 390.0
    r, actions = advance(r, 519.0, True, None, GOOD_OLD, GOOD_NEW)
    assert actions == [], "10 s of the hold were used before the pause; 20 remain after it"
    r, actions = advance(r, 520.0, True, None, GOOD_OLD, GOOD_NEW)
    assert r.step == 1


def test_operator_rollback_in_any_phase_before_retirement():
    for r in (start(SPEC, 0.0)[0], _shifting(), pause(_shifting(step=1), 200.0)):
        back, actions = roll_back(r, 300.0, "operator asked")
        assert back.phase is Phase.ROLLING_BACK and not back.paused
        assert actions == [SetWeights({"v1": 100, "v2": 0}), RemoveVersion("v2")]
    promoted = _shifting(step=2)
    promoted, _ = advance(promoted, 400.0, True, None, GOOD_OLD, GOOD_NEW)
    assert promoted.phase is Phase.PROMOTED
    assert roll_back(promoted, 401.0, "too late") == (promoted, []), "the old version is already retiring"


def test_saved_state_resumes_where_it_was():
    """The controller saves the state after every tick; after a crash it loads it and goes on."""
    r = _shifting(step=1)
    saved = json.dumps(r.to_dict())
    again = Rollout.from_dict(json.loads(saved))
    assert again == r
    a = advance(r, 200.0, True, None, GOOD_OLD, GOOD_NEW)
    b = advance(again, 200.0, True, None, GOOD_OLD, GOOD_NEW)
    assert a == b


def test_gate_arithmetic():
    gates = Gates()
    assert evaluate_gates(GOOD_OLD, GOOD_NEW, gates).verdict == "pass"
    tiny = WindowStats(requests=50, ttft_p95_s=0.04, e2e_p95_s=0.08)
    tiny_old = WindowStats(requests=50, ttft_p95_s=0.01, e2e_p95_s=0.05)
    assert evaluate_gates(tiny_old, tiny, gates).verdict == "pass", "4x of nothing is noise"
    one_error = WindowStats(requests=5, errors=1)
    assert evaluate_gates(GOOD_OLD, one_error, gates).verdict == "wait", "one error in five proves little"
    no_old = WindowStats()
    assert evaluate_gates(no_old, GOOD_NEW, gates).verdict == "pass", "nothing to compare latency with"


def test_spec_is_checked():
    for bad in (dict(steps=(10, 50)), dict(steps=(50, 10, 100)), dict(steps=(0, 100)), dict(new="v1"),
                dict(hold_s=10, max_hold_s=5)):
        with pytest.raises(ValueError):
            RolloutSpec(**{"model": "m", "old": "v1", "new": "v2", **bad})


def test_percentile_nearest_rank():
    assert percentile([], 0.95) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.95) == 95.0
