"""Turn a run's `RequestRecord`s into the numbers a benchmark reports: percentiles, throughput, goodput.

Pure Python on purpose: the percentile definition is short enough to check by eye, and the summary has
to agree with what numpy's default ("linear") method would say, so results stay comparable with other
tools without dragging numpy into the measurement path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from shunter.bench.records import RequestRecord

# Status key for failures that never got an HTTP status (connection refused, reset, timeout).
TRANSPORT_ERROR = "transport"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]), interpolating linearly between the two closest ranks.

    Matches `numpy.percentile(values, q)` with the default "linear" method: rank q/100 * (n - 1) in the
    sorted values, and a straight line between its neighbours when the rank falls between two of them.
    """
    if not values:
        raise ValueError("percentile of an empty sequence is undefined")
    if not 0.0 <= q <= 100.0:  # also rejects NaN
        raise ValueError(f"percentile q must be within [0, 100], got {q!r}")
    ordered = sorted(float(v) for v in values)
    rank = q / 100.0 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution(values: Iterable[float]) -> dict[str, Any]:
    """p50 / p90 / p99 / mean / count of `values`; all None (count 0) when there is nothing to describe.

    None rather than 0 for an empty input, so "no data" can never be mistaken for "instant".
    """
    data = [float(v) for v in values]
    if not data:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "count": 0}
    return {
        "p50": percentile(data, 50),
        "p90": percentile(data, 90),
        "p99": percentile(data, 99),
        "mean": sum(data) / len(data),
        "count": len(data),
    }


def mean_itl(record: RequestRecord) -> float | None:
    """A request's time per output token after the first (TPOT): its mean inter-chunk gap; None without gaps."""
    return sum(record.itl_s) / len(record.itl_s) if record.itl_s else None


def meets_slo(record: RequestRecord, slo_ttft_s: float | None = None, slo_itl_s: float | None = None) -> bool:
    """Whether one request counts toward goodput.

    It must have succeeded; with a TTFT SLO its TTFT must be known and within it; with an ITL SLO its mean
    gap must be within it (a request with no gaps, one chunk or none, has nothing to violate).
    """
    if not record.ok:
        return False
    if slo_ttft_s is not None and (record.ttft_s is None or record.ttft_s > slo_ttft_s):
        return False
    tpot = mean_itl(record)
    return not (slo_itl_s is not None and tpot is not None and tpot > slo_itl_s)


def errors_by_status(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Failed requests counted by HTTP status (as a string, for JSON); no status counts as "transport"."""
    counts: dict[str, int] = {}
    for rec in records:
        if not rec.ok:
            key = TRANSPORT_ERROR if rec.status is None else str(rec.status)
            counts[key] = counts.get(key, 0) + 1
    # Numeric statuses first, in order, then "transport": stable output for diffs and tables.
    return dict(sorted(counts.items(), key=lambda kv: (not kv[0].isdigit(), kv[0])))


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    slo_ttft_s: float | None = None,
    slo_itl_s: float | None = None,
) -> dict[str, Any]:
    """The JSON-serializable summary of one run.

    Latency and token figures describe succeeded requests only: a fast 429 is not a fast answer.
    Goodput's fraction is over ALL requests, so failures count against it as requests that missed the SLO.
    """
    _check_positive("duration_s", duration_s, allow_zero=False)
    for name, slo in (("slo_ttft_s", slo_ttft_s), ("slo_itl_s", slo_itl_s)):
        if slo is not None:
            _check_positive(name, slo, allow_zero=True)

    total = len(records)
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [t for t in (mean_itl(r) for r in done) if t is not None]
    good = sum(1 for r in records if meets_slo(r, slo_ttft_s, slo_itl_s))
    return {
        "requests": total,
        "succeeded": len(done),
        "failed": total - len(done),
        "success_rate": len(done) / total if total else 0.0,
        "errors_by_status": errors_by_status(records),
        "duration_s": float(duration_s),
        "requests_per_s": len(done) / duration_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration_s,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "ttft_s": distribution(r.ttft_s for r in done if r.ttft_s is not None),
        "itl_s": distribution(gap for r in done for gap in r.itl_s),
        "tpot_s": distribution(tpots),
        "e2e_s": distribution(r.e2e_s for r in done if r.e2e_s is not None),
        "goodput": {
            "slo_ttft_s": slo_ttft_s,
            "slo_itl_s": slo_itl_s,
            "requests_meeting_slo": good,
            "fraction": good / total if total else 0.0,
            "requests_per_s": good / duration_s,
        },
    }


def _check_positive(name: str, value: float, *, allow_zero: bool) -> None:
    # NaN and inf would silently poison every rate derived from them; refuse them at the door.
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
