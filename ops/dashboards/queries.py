"""PromQL over Shunter's metrics, with every name taken from the metric catalog.

A name not in `shunter.metric_catalog` fails here, when the dashboards are generated, not in
Grafana as an empty panel. The aggregations follow how each kind is recorded: Ray exports a series
per recording process (its `WorkerId`, `NodeAddress`, ... labels), so counters and histograms are
summed by the catalog's own labels before anything else, and gauges are summed when each process
holds a share of the total (requests in flight) or maxed when every process reports the same thing
(a replica count, a weight).
"""

from __future__ import annotations

from collections.abc import Sequence

from shunter import metric_catalog

RATE_WINDOW = "[$__rate_interval]"

# Label filters from the dashboards' template variables (multi-value variables expand to a regex).
MODEL = 'model=~"$model"'
MODEL_VERSION = 'model=~"$model", version=~"$version"'

# A failed request, as the gateway counts it: any 5xx (engine errors and 503 refusals) and a stream
# that broke after its 200 head. A client's 4xx and a 429 (admission control) are not failures.
FAILED_STATUS = 'status=~"5..|stream_error"'

# Requests the platform owed an answer: successes, failures and 429 refusals (overload is the
# platform's doing); not client errors such as 400 or 499 (the client went away).
OWED_STATUS = 'status=~"2..|5..|stream_error|429"'


def series(name: str, suffix: str = "") -> str:
    """The exported name of a catalog metric; `suffix` picks one of a histogram's series."""
    spec = metric_catalog.spec(name)
    if suffix and spec.kind != "histogram":
        raise ValueError(f"{name} is a {spec.kind}: it has no {suffix} series")
    if spec.kind == "histogram" and suffix not in ("_bucket", "_sum", "_count"):
        raise ValueError(f"{name} is a histogram: pick its _bucket, _sum or _count series")
    return spec.exported + suffix


def selector(name: str, matchers: str, suffix: str = "") -> str:
    return f"{series(name, suffix)}{{{matchers}}}"


def _by(labels: Sequence[str]) -> str:
    return f"sum by ({', '.join(labels)})" if labels else "sum"


def rate(name: str, matchers: str, by: Sequence[str] = (), suffix: str = "") -> str:
    """Per-second rate of a counter (or a histogram's series), summed over Ray's per-process series."""
    return f"{_by(by)} (rate({selector(name, matchers, suffix)}{RATE_WINDOW}))"


def increase(name: str, matchers: str, by: Sequence[str] = ()) -> str:
    """Events over the trailing rate window, for rare events (rollout decisions, breaker trips) whose
    rate would read as tiny fractions per second. Windows of neighbouring points overlap, so read
    each point on its own rather than summing them."""
    return f"{_by(by)} (increase({selector(name, matchers)}{RATE_WINDOW}))"


def ratio(numerator: str, denominator: str) -> str:
    return f"{numerator} / {denominator}"


def share(part: str, whole: str) -> str:
    """`part / whole` where `part` counts a subset of `whole`'s events (failed requests, cache hits).
    A counter appears only once something was counted, so with no failures yet `part` has no series
    and a plain division shows "No data" instead of 0; `or whole * 0` fills the gap with zeros."""
    return ratio(f"({part} or {whole} * 0)", whole)


def quantile(q: float, name: str, matchers: str, by: Sequence[str] = ()) -> str:
    """The q-quantile of a histogram, interpolated within its catalog buckets."""
    buckets = rate(name, matchers, by=("le", *by), suffix="_bucket")
    return f"histogram_quantile({q}, {buckets})"


def mean(name: str, matchers: str, by: Sequence[str] = ()) -> str:
    """The mean of a histogram's observations over the interval."""
    return ratio(rate(name, matchers, by, suffix="_sum"), rate(name, matchers, by, suffix="_count"))


def goodput(histogram: str, matchers: str, bound: str, by: Sequence[str] = ()) -> str:
    """Share of the requests the platform owed an answer that succeeded within `bound` seconds.

    The gateway observes latency only for successful (2xx) requests, so the histogram's own count
    would leave failures out and a failing model would look fast; the denominator is therefore the
    request counter's OWED_STATUS. `bound` must be one of the histogram's bucket boundaries (an SLO
    variable whose options are boundaries): `le` selects exactly one bucket series."""
    within = rate(histogram, f'{matchers}, le="{bound}"', by, suffix="_bucket")
    return share(within, rate("shunter_requests_total", f"{matchers}, {OWED_STATUS}", by))


def error_ratio(matchers: str, by: Sequence[str] = ()) -> str:
    """Failed requests over all answered ones."""
    failed = rate("shunter_requests_total", f"{matchers}, {FAILED_STATUS}", by)
    return share(failed, rate("shunter_requests_total", matchers, by))


def gauge_sum(name: str, matchers: str, by: Sequence[str]) -> str:
    """A gauge each process holds a share of (requests in flight at each gateway replica)."""
    return f"sum by ({', '.join(by)}) ({selector(name, matchers)})"


def gauge_max(name: str, matchers: str, by: Sequence[str]) -> str:
    """A gauge every reporting process states whole (a replica count, a weight, a state): summing
    the copies would multiply it."""
    return f"max by ({', '.join(by)}) ({selector(name, matchers)})"
