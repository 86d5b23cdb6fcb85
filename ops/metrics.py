"""Operations metrics (exported by Ray as `ray_shunter_*`, like every Shunter metric; names, labels and
buckets: `shunter.metric_catalog`).

From the autoscaling policy (in Ray Serve's controller), per model version:
- `shunter_autoscaling_desired_replicas{model,version}`: what the policy asks for (0 for a retired version);
- `shunter_autoscaling_running_replicas{model,version}`: replicas running when it decided;
- `shunter_autoscaling_standby_replicas{model,version}`: of those, the warm standby ones (routed nothing);
- `shunter_queue_depth{model,version}`: requests waiting or running in the engines plus queued ahead of them.

From the rollout controller (the application's control actor):
- `shunter_rollout_phase{model,phase}`: 1 for the phase a model's latest rollout is in, 0 for the others;
- `shunter_rollout_step{model}`: the step the rollout holds (1-based; 0 when not shifting);
- `shunter_rollout_gate{model,gate}`: the gate values of the latest judgement (error rates, p95s);
- `shunter_rollout_decisions_total{model,decision}`: `ready`, `step`, `promote`, `rollback`, `done`,
  `pause`, `resume`.

From the gateway:
- `shunter_traffic_weight{model,version}`: percent of the model's traffic each version gets, as applied;
- `shunter_rejections_total{model, reason}`: requests turned away before any replica took them:
  `queue_full` (429, admission control), `cold_start_timeout`, `queue_timeout`, `replicas_unavailable`,
  `model_unavailable` (503s);
- `shunter_drain_seconds{model}`: how long a leaving replica took to finish the streams this gateway
  relayed from it;
- `shunter_drain_aborted_total{model}`: streams ended at the drain timeout.
"""

from __future__ import annotations

from typing import Any

from shunter.metric_catalog import build
from shunter.ray_metrics import LazyMetrics

# Short names the recording functions below use, for the catalog's full names.
_SHORT = {"desired": "shunter_autoscaling_desired_replicas", "running": "shunter_autoscaling_running_replicas",
          "standby": "shunter_autoscaling_standby_replicas",
          "depth": "shunter_queue_depth", "rollout_phase": "shunter_rollout_phase",
          "rollout_step": "shunter_rollout_step", "weight": "shunter_traffic_weight", "gate": "shunter_rollout_gate",
          "decisions": "shunter_rollout_decisions_total", "rejections": "shunter_rejections_total",
          "drain": "shunter_drain_seconds", "aborted": "shunter_drain_aborted_total"}


def _build(metrics: Any) -> dict[str, Any]:
    built = build(metrics, tuple(_SHORT.values()))
    return {short: built[name] for short, name in _SHORT.items()}


_get = LazyMetrics(_build).get


def autoscaling(model: str, desired: int, running: int, depth: float, version: str = "default") -> None:
    m = _get()
    if m:
        tags = {"model": model, "version": version}
        m["desired"].set(desired, tags=tags)
        m["running"].set(running, tags=tags)
        m["depth"].set(depth, tags=tags)


def standby(model: str, replicas: int, version: str = "default") -> None:
    m = _get()
    if m:
        m["standby"].set(replicas, tags={"model": model, "version": version})


def traffic_weight(model: str, version: str, percent: float) -> None:
    m = _get()
    if m:
        m["weight"].set(percent, tags={"model": model, "version": version})


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


def rollout(model: str, phase: str, step: int | None, gates: dict[str, Any] | None, decision: str | None) -> None:
    m = _get()
    if not m:
        return
    for name in ROLLOUT_PHASES:
        m["rollout_phase"].set(1 if name == phase else 0, tags={"model": model, "phase": name})
    m["rollout_step"].set(0 if step is None else step + 1, tags={"model": model})
    for gate, value in (gates or {}).items():  # a gate without a value (no traffic) is NaN, not stale
        m["gate"].set(float(value) if isinstance(value, int | float) else float("nan"),
                      tags={"model": model, "gate": gate})
    if decision:
        m["decisions"].inc(1, tags={"model": model, "decision": decision})
