"""Routing metrics, exported through Ray's metrics (so a cluster's Prometheus scrapes them with Ray's).

- `shunter_routing_decisions_total{model, policy, reason}`: one count per placement with its reason
  (prefix_hit, load_fallback, least_loaded; power_of_two and custom policies record their own name),
  plus one per breaker skip (breaker_skip: an open replica
  was left out) and per failover (retry: the gateway sent a request again after a replica failed).
- `shunter_routing_prefix_match_ratio{model}`: share of each routed prompt the chosen replica held.
- `shunter_breaker_state{model, replica}`: 0 closed, 1 half-open, 2 open.
- `shunter_breaker_transitions_total{model, replica, to}`.

Outside a Ray worker every call is a no-op (see `shunter.ray_metrics`).
"""

from __future__ import annotations

from typing import Any

from shunter.ray_metrics import LazyMetrics

_RATIO_BUCKETS = [0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99]


def _build(metrics: Any) -> dict[str, Any]:
    return {
        "decisions": metrics.Counter(
            "shunter_routing_decisions_total",
            description="Routing decisions by reason (prefix_hit, load_fallback, least_loaded, "
            "breaker_skip, retry).",
            tag_keys=("model", "policy", "reason"),
        ),
        "match": metrics.Histogram(
            "shunter_routing_prefix_match_ratio",
            description="Share of each routed prompt that the chosen replica held in its KV cache.",
            boundaries=_RATIO_BUCKETS,
            tag_keys=("model",),
        ),
        "breaker": metrics.Gauge(
            "shunter_breaker_state",
            description="Circuit breaker per replica: 0 closed, 1 half-open, 2 open.",
            tag_keys=("model", "replica"),
        ),
        "transitions": metrics.Counter(
            "shunter_breaker_transitions_total",
            description="Circuit breaker state changes per replica.",
            tag_keys=("model", "replica", "to"),
        ),
    }


_get = LazyMetrics(_build).get


def decision(model: str, policy: str, reason: str) -> None:
    m = _get()
    if m:
        m["decisions"].inc(1, tags={"model": model, "policy": policy, "reason": reason})


def prefix_match(model: str, fraction: float) -> None:
    m = _get()
    if m:
        m["match"].observe(fraction, tags={"model": model})


def breaker_state(model: str, replica: str, level: int, to: str | None = None) -> None:
    m = _get()
    if m:
        m["breaker"].set(level, tags={"model": model, "replica": replica})
        if to is not None:
            m["transitions"].inc(1, tags={"model": model, "replica": replica, "to": to})
