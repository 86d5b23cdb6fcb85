"""Operations metrics (exported by Ray as `ray_shunter_*`, like every Shunter metric).

From the autoscaling policy (in Ray Serve's controller):
- `shunter_autoscaling_desired_replicas{model}`: what the policy asks for;
- `shunter_autoscaling_running_replicas{model}`: replicas running when it decided;
- `shunter_queue_depth{model}`: requests waiting or running in the engines plus queued ahead of them.

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
                                 description="Replicas the queue-depth policy asks for.", tag_keys=("model",)),
        "running": metrics.Gauge("shunter_autoscaling_running_replicas",
                                 description="Replicas running when the policy decided.", tag_keys=("model",)),
        "depth": metrics.Gauge("shunter_queue_depth",
                               description="Requests waiting or running in the engines plus queued ahead "
                               "of the replicas.", tag_keys=("model",)),
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


def autoscaling(model: str, desired: int, running: int, depth: float) -> None:
    m = _get()
    if m:
        tags = {"model": model}
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
