"""Grafana's side of a panel query: its variables, replaced before the query goes to Prometheus."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import promql_parser as pp

_VARIABLE = re.compile(r"\$\{(\w+)(?::[\w-]+)?\}|\$(\w+)")
_ALL = ("All", "$__all")


class VariableError(ValueError):
    pass


def interpolate(expr: str, variables: Mapping[str, str | Sequence[str]] | None = None,
                rate_interval: str = "1m", interval: str | None = None, range_: str | None = None) -> str:
    """Replace Grafana's variables in a panel query, as Grafana does before sending it to Prometheus.

    `$__rate_interval`, `$__interval` and `$__range` (plus `_ms`/`_s` forms) come from the arguments
    (`interval` and `range_` default to `rate_interval`); `$name`, `${name}` and `${name:format}` from
    `variables`. "All" (or `$__all`) becomes `.*`, and a list of values the regex `(a|b)`, which is how
    the dashboards' `=~"$model"` matchers expect multi-value variables. `$1`-style references (in
    label_replace) are left alone; any other unknown variable raises VariableError, since a query with a
    literal `$model` in it would only fail later with a less helpful message.
    """
    values = _builtin_variables(rate_interval, interval or rate_interval, range_ or rate_interval)
    values.update({name: _variable_value(value) for name, value in (variables or {}).items()})

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in values:
            return values[name]
        if name.isdigit():
            return match.group(0)
        raise VariableError(f"dashboard variable ${name} has no value (query {expr!r})")

    return _VARIABLE.sub(replace, expr)


def format_duration(seconds: float) -> str:
    """A PromQL duration for `seconds`, in whole milliseconds when it is not whole seconds."""
    millis = max(1, round(seconds * 1000))
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


def grafana_rate_interval(scrape_interval_s: float | None, step_s: float) -> str:
    """Grafana's `$__rate_interval`: max(4 x scrape interval, step + scrape interval).

    Four scrapes guarantee a rate window holds at least two samples even with one scrape missed.
    """
    scrape = scrape_interval_s if scrape_interval_s else step_s
    return format_duration(max(4 * scrape, step_s + scrape))


def _variable_value(value: str | Sequence[str]) -> str:
    if isinstance(value, str):
        return ".*" if value in _ALL else value
    values = list(value)
    if not values or any(v in _ALL for v in values):
        return ".*"
    return values[0] if len(values) == 1 else "(" + "|".join(values) + ")"


def _builtin_variables(rate_interval: str, interval: str, range_: str) -> dict[str, str]:
    interval_s = _duration_s(interval)
    range_s = _duration_s(range_)
    return {
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__interval_ms": str(round(interval_s * 1000)),
        "__range": range_,
        "__range_s": str(round(range_s)),
        "__range_ms": str(round(range_s * 1000)),
    }


def _duration_s(duration: str) -> float:
    try:
        return pp.parse_duration(duration).total_seconds()
    except ValueError as exc:
        raise VariableError(f"invalid duration {duration!r}: {exc}") from exc
