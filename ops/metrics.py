"""Operations metrics (exported by Ray as `ray_shunter_*`, like every Shunter metric).

From the autoscaling policy (in Ray Serve's controller), per model version:
- `shunter_autoscaling_desired_replicas{model,version}`: what the policy asks for (0 for a retired version);
- `shunter_autoscaling_running_replicas{model,version}`: replicas running when it decided;
- `shunter_queue_depth{model,version}`: requests waiting or running in the engines plus queued ahead of them.

From the rollout controller (the application's control actor):
- `shunter_rollout_phase{model,phase}`: 1 for the phase a model's latest rollout is in, 0 for the others;
- `shunter_rollout_step{model}`: the step the rollout holds (1-based; 0 when not shifting);
- `shunter_traffic_weight{model,version}`: percent of the model's traffic each version gets;
- `shunter_rollout_gate{model,gate}`: the gate values of the latest judgement (error rates, p95s);
- `shunter_rollout_decisions_total{model,decision}`: `ready`, `step`, `promote`, `rollback`, `done`,
  `pause`, `resume`.

From the gateway:
- `shunter_rejections_total{model, reason}`: requests turned away before any replica took them:
  `queue_full` (429, admission control), `cold_start_timeout`, `queue_timeout`, `replicas_unavailable`,
  `model_unavailable` (503s);
- `shunter_drain_seconds{model}`: how long a leaving replica took to finish the streams this gateway
  relayed from it;
- `shunter_drain_aborted_total{model}`: streams ended at the drain timeout.
"""

from __future__ import annotations

from typing import Any

from shunter.ray_metrics import LazyMetrics

_DRAIN_BUCKETS = [0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600]


def _build(metrics: Any) -> dict[str, Any]:
    return {
        "desired": metrics.Gauge("shunter_autoscaling_desired_replicas",
                                 description="Replicas the queue-depth policy asks for.",
                                 tag_keys=("model", "version")),
        "running": metrics.Gauge("shunter_autoscaling_running_replicas",
                                 description="Replicas running when the policy decided.",
                                 tag_keys=("model", "version")),
        "depth": metrics.Gauge("shunter_queue_depth",
                               description="Requests waiting or running in the engines plus queued ahead "
                               "of the replicas.", tag_keys=("model", "version")),
        "rollout_phase": metrics.Gauge("shunter_rollout_phase", description="1 for the phase the model's "
                                       "latest rollout is in.", tag_keys=("model", "phase")),
        "rollout_step": metrics.Gauge("shunter_rollout_step", description="The step a rollout holds (1-based; "
                                      "0 when not shifting).", tag_keys=("model",)),
        "weight": metrics.Gauge("shunter_traffic_weight", description="Percent of a model's traffic per version.",
                                tag_keys=("model", "version")),
        "gate": metrics.Gauge("shunter_rollout_gate", description="Gate values of a rollout's latest judgement.",
                              tag_keys=("model", "gate")),
        "decisions": metrics.Counter("shunter_rollout_decisions_total", description="Rollout decisions.",
                                     tag_keys=("model", "decision")),
        "rejections": metrics.Counter("shunter_rejections_total",
                                      description="Requests refused before a replica took them, by reason.",
                                      tag_keys=("model", "reason")),
        "drain": metrics.Histogram("shunter_drain_seconds",
                                   description="Time a leaving replica took to finish the streams relayed "
                                   "from it.", boundaries=_DRAIN_BUCKETS, tag_keys=("model",)),
        "aborted": metrics.Counter("shunter_drain_aborted_total",
                                   description="Streams ended at the drain timeout.", tag_keys=("model",)),
    }


_get = LazyMetrics(_build).get


def autoscaling(model: str, desired: int, running: int, depth: float, version: str = "default") -> None:
    m = _get()
    if m:
        tags = {"model": model, "version": version}
        m["desired"].set(desired, tags=tags)
        m["running"].set(running, tags=tags)
        m["depth"].set(depth, tags=tags)


def rejection(model: str, reason: str) -> None:
    m = _get()
    if m:
        m["rejections"].inc(1, tags={"model": model, "reason": reason})


def drain_finished(model: str, seconds: float) -> None:
    m = _get()
    if m:
        m["drain"].observe(seconds, tags={"model": model})


def drain_aborted(model: str) -> None:
    m = _get()
    if m:
        m["aborted"].inc(1, tags={"model": model})


ROLLOUT_PHASES = ("deploying", "shifting", "promoted", "rolling_back", "done")


def rollout(model: str, phase: str, step: int | None, weights: dict[str, float], gates: dict[str, Any] | None,
            decision: str | None) -> None:
    m = _get()
    if not m:
        return
    for name in ROLLOUT_PHASES:
        m["rollout_phase"].set(1 if name == phase else 0, tags={"model": model, "phase": name})
    m["rollout_step"].set(0 if step is None else step + 1, tags={"model": model})
    for version, share in weights.items():
        m["weight"].set(share, tags={"model": model, "version": version})
    for gate, value in (gates or {}).items():
        if isinstance(value, int | float):
            m["gate"].set(float(value), tags={"model": model, "gate": gate})
    if decision:
        m["decisions"].inc(1, tags={"model": model, "decision": decision})
