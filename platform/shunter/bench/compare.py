"""Side-by-side text table of several runs' summaries, for terminals, logs and PR descriptions.

Each run is a dict with "label" and "summary" (what `shunter.bench.stats.summarize` returns). The first
run is the baseline: every other run also gets a "ratio vs <baseline>" column, so a change reads as
"1.32x" instead of two numbers to divide in one's head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MS = 1000.0

Getter = Callable[[dict[str, Any]], float | None]


def _ms(section: str, key: str) -> Getter:
    def get(summary: dict[str, Any]) -> float | None:
        value = summary[section][key]
        return None if value is None else value * _MS

    return get


# (row name, how to read it from a summary, number format)
_ROWS: list[tuple[str, Getter, str]] = [
    ("requests", lambda s: s["requests"], "d"),
    ("success rate", lambda s: s["success_rate"], ".3f"),
    ("output tok/s", lambda s: s["output_tokens_per_s"], ".1f"),
    ("requests/s", lambda s: s["requests_per_s"], ".2f"),
    ("TTFT p50 (ms)", _ms("ttft_s", "p50"), ".1f"),
    ("TTFT p90 (ms)", _ms("ttft_s", "p90"), ".1f"),
    ("TTFT p99 (ms)", _ms("ttft_s", "p99"), ".1f"),
    ("ITL p50 (ms)", _ms("itl_s", "p50"), ".1f"),
    ("ITL p99 (ms)", _ms("itl_s", "p99"), ".1f"),
    ("E2E p50 (ms)", _ms("e2e_s", "p50"), ".1f"),
    ("E2E p99 (ms)", _ms("e2e_s", "p99"), ".1f"),
    ("goodput fraction", lambda s: s["goodput"]["fraction"], ".3f"),
]

MISSING = "-"


def compare_table(results: list[dict[str, Any]]) -> str:
    """A monospace table: one row per metric, one column per run, then one ratio column per non-baseline run.

    A ratio is value / baseline value; it is "-" when either side is missing or the baseline is zero.
    """
    if not results:
        raise ValueError("compare_table needs at least one result")
    labels = [str(r["label"]) for r in results]
    # With one challenger "ratio vs A" is unambiguous; with several, each ratio column names its run too.
    prefix = (lambda label: "") if len(labels) == 2 else (lambda label: f"{label} ")
    header = ["metric", *labels, *(f"{prefix(label)}ratio vs {labels[0]}" for label in labels[1:])]
    body = [_row(name, getter, fmt, results) for name, getter, fmt in _ROWS]
    return _render(header, body)


def _row(name: str, getter: Getter, fmt: str, results: list[dict[str, Any]]) -> list[str]:
    values = [getter(r["summary"]) for r in results]
    cells = [name, *(_fmt(v, fmt) for v in values)]
    base = values[0]
    for value in values[1:]:
        cells.append(MISSING if value is None or not base else f"{value / base:.2f}x")
    return cells


def _fmt(value: float | None, fmt: str) -> str:
    return MISSING if value is None else format(value, fmt)


def _render(header: list[str], body: list[list[str]]) -> str:
    # Metric names left-aligned, numbers right-aligned so their decimal points line up.
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(row) for row in body)])
