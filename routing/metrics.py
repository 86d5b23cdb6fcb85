"""Routing metrics, recorded by the routers and breakers in each gateway process and exported through
Ray's metrics (names, labels and meaning: `shunter.metric_catalog`):
- `shunter_routing_decisions_total{model, version, policy, reason}`: one count per placement with its
  reason (prefix_hit, load_fallback, least_loaded; power_of_two and custom policies record their own
  name), plus one per breaker skip (breaker_skip) and per failover (retry);
- `shunter_routing_prefix_match_ratio{model, version}`: share of each routed prompt the chosen replica held;
- `shunter_routing_prefix_predicted_tokens_total`, `..._cached_tokens_total` and the histogram
  `..._prediction_error_tokens` `{model, version, source}`: the router's prediction against the engine's
  cached tokens, per request whose usage says them;
- `shunter_breaker_state{model, version, replica}`: 0 closed, 1 half-open, 2 open;
- `shunter_breaker_transitions_total{model, version, replica, to}`.
Outside a Ray worker every call is a no-op (see `shunter.ray_metrics`).
"""

from __future__ import annotations

from shunter.metric_catalog import build
from shunter.ray_metrics import LazyMetrics

_NAMES = ("shunter_routing_decisions_total", "shunter_routing_prefix_match_ratio", "shunter_breaker_state",
          "shunter_breaker_transitions_total", "shunter_routing_prefix_predicted_tokens_total",
          "shunter_routing_prefix_cached_tokens_total", "shunter_routing_prefix_prediction_error_tokens")
_get = LazyMetrics(lambda metrics: build(metrics, _NAMES)).get


def decision(model: str, version: str, policy: str, reason: str) -> None:
    m = _get()
    if m:
        m["shunter_routing_decisions_total"].inc(1, tags={"model": model, "version": version, "policy": policy,
                                                          "reason": reason})


def prefix_match(model: str, version: str, fraction: float) -> None:
    m = _get()
    if m:
        m["shunter_routing_prefix_match_ratio"].observe(fraction, tags={"model": model, "version": version})


def prefix_prediction(model: str, version: str, source: str, predicted: int, cached: int) -> None:
    """One routed request's prefix, as the router predicted it (tokens the chosen replica held) and as the
    engine found it (its usage's cached tokens)."""
    m = _get()
    if m:
        tags = {"model": model, "version": version, "source": source}
        if predicted > 0:  # Ray's counters take positive increments only
            m["shunter_routing_prefix_predicted_tokens_total"].inc(predicted, tags=tags)
        if cached > 0:
            m["shunter_routing_prefix_cached_tokens_total"].inc(cached, tags=tags)
        m["shunter_routing_prefix_prediction_error_tokens"].observe(abs(predicted - cached), tags=tags)


def breaker_state(model: str, version: str, replica: str, level: int, to: str | None = None) -> None:
    m = _get()
    if m:
        tags = {"model": model, "version": version, "replica": replica}
        m["shunter_breaker_state"].set(level, tags=tags)
        if to is not None:
            m["shunter_breaker_transitions_total"].inc(1, tags={**tags, "to": to})


def breaker_forget(model: str, version: str, replica: str) -> None:
    """The replica left: its breaker series stops (gauges keep reporting their last value otherwise)."""
    m = _get()
    if m:
        m["shunter_breaker_state"].clear(model=model, version=version, replica=replica)
