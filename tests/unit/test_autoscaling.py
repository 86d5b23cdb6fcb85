"""Queue-depth autoscaling arithmetic and hysteresis (ops/autoscaling.py), with an explicit clock."""

from __future__ import annotations

import pytest

from shunter.ops.autoscaling import ScalingSettings, ScalingState, decide, replicas_needed

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


# ---- the Ray policy and the config that drives it ----------------------------------------------


def _ctx(current: int, engine: dict | None, queued: float = 0, total: float = 0, now: float = 0.0, state=None):
    from types import SimpleNamespace

    metrics = {"engine_requests": engine} if engine is not None else {}
    return SimpleNamespace(current_num_replicas=current, target_num_replicas=current, aggregated_metrics=metrics,
                           total_queued_requests=queued,
                           total_num_requests=total, current_time=now, policy_state=state or {})


def test_policy_reads_the_engines_queues_plus_requests_queued_ahead():
    from shunter.ops.autoscaling import QueueDepthPolicy, queue_depth

    assert queue_depth(_ctx(2, {"a": 10, "b": 7}, queued=5, total=99)) == 22
    assert queue_depth(_ctx(2, None, total=9)) == 9, "before replicas report, Ray's own count stands in"
    policy = QueueDepthPolicy(min_replicas=1, max_replicas=3, target_per_replica=8, upscale_delay_s=5,
                              downscale_delay_s=30)
    replicas, state = policy(_ctx(1, {"a": 20}, now=100.0))
    assert replicas == 1 and state["up_since"] == 100.0 and "pending" in state["reason"]
    replicas, state = policy(_ctx(1, {"a": 20}, now=105.0, state=state))
    assert replicas == 3


def test_autoscaling_config_excludes_a_fixed_count_and_checks_bounds():
    from shunter.config import ConfigError, parse_config

    smol = {"name": "s", "source": "builtin:smollm2-135m-instruct"}
    with pytest.raises(ConfigError, match="either replicas"):
        parse_config({"models": [{**smol, "replicas": 2, "autoscaling": {"max_replicas": 3}}]})
    with pytest.raises(ConfigError, match="exceeds max_replicas"):
        parse_config({"models": [{**smol, "autoscaling": {"min_replicas": 3, "max_replicas": 2}}]})


def test_plan_hands_ray_the_queue_depth_policy_and_plans_cores_for_the_maximum():
    from ray import serve

    from shunter.config import parse_config
    from shunter.deployments.app import deployment_options
    from shunter.deployments.replica.model_server import ModelServer
    from shunter.serve_plan import ClusterView

    cfg = parse_config({"models": [{"name": "s", "source": "builtin:smollm2-135m-instruct",
                                    "autoscaling": {"min_replicas": 0, "max_replicas": 2}}]})
    plan = deployment_options(cfg, ClusterView(has_gpus=False, largest_node_cpus=2))["s"]["default"]
    options = plan["deployment"]
    assert "num_replicas" not in options and plan["cpu_cores"] == 1, "two replicas may run: one core each"
    scaling = options["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["initial_replicas"]) == (0, 2, 1)
    assert scaling["policy"]["policy_function"] == "shunter.ops.autoscaling:QueueDepthPolicy"
    serve.deployment(ModelServer).options(**options)  # Ray's own schema accepts it (and imports the policy)


def test_an_autoscaled_config_survives_a_dump_and_a_second_validation():
    """The builder hands replicas model_dump()s of the config; they validate them again."""
    from shunter.config import ModelConfig, parse_config

    cfg = parse_config({"models": [{"name": "s", "source": "builtin:smollm2-135m-instruct",
                                    "autoscaling": {"max_replicas": 3}}]})
    again = ModelConfig.model_validate(cfg.models[0].model_dump(mode="json"))
    assert again.autoscaling is not None and again.autoscaling.max_replicas == 3


def test_a_count_outside_the_bounds_moves_inside_at_once():
    assert _run(0, [(0, 0)]) == [1], "below min_replicas: no upscale delay"
    assert _run(6, [(0, 0)]) == [4]


def test_policy_holds_at_the_target_ray_is_moving_to():
    """A replica that is starting counts: holding at the running count would cancel it."""
    from shunter.ops.autoscaling import QueueDepthPolicy

    policy = QueueDepthPolicy(min_replicas=1, max_replicas=3, target_per_replica=8, upscale_delay_s=5,
                              downscale_delay_s=30)
    ctx = _ctx(1, {"a": 10}, now=0.0)
    ctx.target_num_replicas = 2  # one running, one starting
    replicas, _ = policy(ctx)
    assert replicas == 2


def test_no_scale_down_while_a_replica_is_still_starting():
    """A min-0 model's first replica (or one started for a burst that passed) is not stopped mid-start;
    the downscale delay counts from when every replica runs."""
    from shunter.ops.autoscaling import QueueDepthPolicy

    policy = QueueDepthPolicy(model="m", min_replicas=0, max_replicas=2, target_per_replica=8, upscale_delay_s=5,
                              downscale_delay_s=5)
    ctx = _ctx(0, None, now=0.0)
    ctx.target_num_replicas = 1  # starting, not running
    for now in (0.0, 10.0, 60.0):
        ctx.current_time = now
        replicas, state = policy(ctx)
        assert replicas == 1, now
        ctx.policy_state = state
    ctx.current_num_replicas = 1  # it runs now: the delay starts
    ctx.current_time = 61.0
    replicas, ctx.policy_state = policy(ctx)
    assert replicas == 1
    ctx.current_time = 67.0
    assert policy(ctx)[0] == 0


def test_a_replica_that_never_starts_does_not_pin_the_count_up():
    from shunter.ops.autoscaling import MAX_START_HOLD_S, ScalingState, decide

    state = ScalingState()
    settings = S
    for now in (0.0, MAX_START_HOLD_S / 2):
        decision = decide(2, 0, now, settings, state, starting=1)
        assert decision.replicas == 2
        state = decision.state
    decision = decide(2, 0, MAX_START_HOLD_S + 1, settings, state, starting=1)
    state = decision.state
    later = decide(2, 0, MAX_START_HOLD_S + 1 + settings.downscale_delay_s, settings, state, starting=1)
    assert later.replicas < 2, "after the hold, the normal downscale delay applies"


def test_batch_work_soaks_up_replicas_but_starts_at_most_its_cap():
    capped = ScalingSettings(min_replicas=0, max_replicas=4, target_per_replica=8, upscale_delay_s=0,
                             downscale_delay_s=30, batch_max_replicas=1)
    assert decide(0, 40, 0, capped, ScalingState(), batch=40).replicas == 1, "batch alone wakes a model: one"
    assert decide(1, 40, 0, capped, ScalingState(), batch=40).replicas == 1, "and starts no more"
    assert decide(1, 40, 0, capped, ScalingState(), batch=16).replicas == 3, "24 urgent need 3"
    # Urgent demand gone, batch work left: down to the cap after the delay, never below it while it runs.
    state = decide(3, 40, 0, capped, ScalingState(), batch=40).state
    assert decide(3, 40, 30, capped, state, batch=40).replicas == 1
    uncapped = ScalingSettings(min_replicas=0, max_replicas=4, target_per_replica=8, upscale_delay_s=0,
                               downscale_delay_s=30)
    assert decide(1, 40, 0, uncapped, ScalingState(), batch=40).replicas == 4, "no cap: batch counts as all work"


def test_the_batch_cap_defaults_to_min_replicas_and_may_not_exceed_max_replicas():
    from shunter.config import ConfigError, parse_config

    smol = {"name": "s", "source": "builtin:smollm2-135m-instruct"}
    cfg = parse_config({"models": [{**smol, "autoscaling": {"min_replicas": 0, "max_replicas": 3}}]})
    assert cfg.models[0].autoscaling.batch_replicas == 1
    cfg = parse_config({"models": [{**smol, "autoscaling": {"min_replicas": 2, "max_replicas": 3}}]})
    assert cfg.models[0].autoscaling.batch_replicas == 2
    with pytest.raises(ConfigError, match="batch_max_replicas"):
        parse_config({"models": [{**smol, "autoscaling": {"max_replicas": 3, "batch_max_replicas": 4}}]})
