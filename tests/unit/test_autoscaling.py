"""Queue-depth autoscaling arithmetic and hysteresis (ops/autoscaling.py), with an explicit clock."""

from __future__ import annotations

import pytest

from ops.autoscaling import ScalingSettings, ScalingState, decide, replicas_needed

S = ScalingSettings(min_replicas=1, max_replicas=4, target_per_replica=8, upscale_delay_s=5, downscale_delay_s=30)


def _run(current: int, depths: list[tuple[float, float]], settings: ScalingSettings = S) -> list[int]:
    """Feed (time, depth) ticks; the count follows each decision. Returns the count after each tick."""
    state, counts = ScalingState(), []
    for now, depth in depths:
        decision = decide(current, depth, now, settings, state)
        current, state = decision.replicas, decision.state
        counts.append(current)
    return counts


def test_need_is_depth_over_target_rounded_up():
    assert [replicas_needed(d, 8) for d in (0, 1, 8, 9, 16, 17)] == [0, 1, 1, 2, 2, 3]


def test_need_is_clamped_to_min_and_max():
    assert _run(1, [(0, 100), (5, 100)])[-1] == 4
    assert _run(2, [(0, 0), (30, 0)])[-1] == 1


def test_upscale_waits_for_the_need_to_last():
    counts = _run(1, [(0, 20), (2, 20), (4, 20), (5, 20)])
    assert counts == [1, 1, 1, 3]


def test_a_one_tick_burst_does_not_scale_up():
    assert _run(1, [(0, 30), (1, 2), (6, 2), (7, 30)]) == [1, 1, 1, 1]


def test_downscale_waits_longer_and_needs_headroom():
    # 2 replicas, depth 9: fits one replica by target (8 is full) but not with headroom: stay at 2.
    assert _run(2, [(t, 9) for t in range(0, 100, 10)])[-1] == 2
    # depth 6 fits one replica at 80%: after the downscale delay, one.
    counts = _run(2, [(0, 6), (10, 6), (29, 6), (30, 6)])
    assert counts == [2, 2, 2, 1]


def test_depth_hovering_at_a_boundary_does_not_flap():
    ticks = [(t, 8 if t % 2 else 9) for t in range(0, 300)]  # around one replica's target
    counts = _run(2, ticks)
    assert set(counts[10:]) == {2}, "no scale-down: 8-9 requests do not fit one replica with headroom"


def test_scale_from_zero_is_immediate_and_scale_to_zero_waits():
    zero = ScalingSettings(min_replicas=0, max_replicas=2, target_per_replica=8, upscale_delay_s=60,
                           downscale_delay_s=30)
    assert _run(0, [(0, 1)], zero) == [1], "a waiting request must not wait out the upscale delay"
    assert _run(1, [(0, 0), (29, 0), (30, 0)], zero) == [1, 1, 0]
    assert _run(1, [(0, 1), (100, 1)], zero) == [1, 1], "never to zero while anything is waiting or running"


def test_a_changed_mind_resets_the_delay():
    counts = _run(1, [(0, 20), (3, 4), (4, 20), (8, 20), (9, 20)])
    assert counts == [1, 1, 1, 1, 3], "the up delay restarts after the need fell back"


def test_state_round_trips_through_a_dict():
    state = ScalingState(up_since=3.5)
    assert ScalingState.from_dict(state.to_dict()) == state
    assert ScalingState.from_dict(None) == ScalingState()


@pytest.mark.parametrize("bad", [
    {"min_replicas": 3, "max_replicas": 2},
    {"max_replicas": 0, "min_replicas": 0},
    {"target_per_replica": 0},
    {"downscale_headroom": 1.5},
])
def test_impossible_settings_are_refused(bad):
    args = {"min_replicas": 1, "max_replicas": 4, "target_per_replica": 8, "upscale_delay_s": 5,
            "downscale_delay_s": 30, **bad}
    with pytest.raises(ValueError):
        ScalingSettings(**args)
