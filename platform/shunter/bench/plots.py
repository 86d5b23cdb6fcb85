"""PNG charts of benchmark runs: latency CDFs for one run, side-by-side bars for several.

matplotlib is imported inside the functions: `shunter bench` imports this module on every run, and most
runs never plot, so the import (hundreds of milliseconds) is only paid by the ones that do. The "Agg"
backend is picked before pyplot loads so plotting works on headless benchmark hosts with no display.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shunter.bench.records import RequestRecord

_MS = 1000.0


def plot_latency_cdfs(result: dict[str, Any], out_png: Path, title: str | None = None) -> Path:
    """Empirical CDFs of TTFT, inter-token gaps and end-to-end latency (ms) over a run's succeeded requests.

    CDFs rather than histograms: they need no bin choice, and any percentile can be read straight off.
    """
    plt = _pyplot()
    done = [r for r in (RequestRecord.from_json(d) for d in result["requests"]) if r.ok]
    panels = [
        ("Time to first token", [r.ttft_s for r in done if r.ttft_s is not None]),
        ("Inter-token latency (all gaps)", [gap for r in done for gap in r.itl_s]),
        ("End-to-end latency", [r.e2e_s for r in done if r.e2e_s is not None]),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    try:
        for ax, (name, seconds) in zip(axes, panels, strict=True):
            _draw_cdf(ax, name, [s * _MS for s in seconds])
        label = result.get("label")
        fig.suptitle(title if title is not None else f"Latency CDFs: {label}" if label else "Latency CDFs")
        fig.tight_layout()
        return _save(fig, out_png)
    finally:
        plt.close(fig)


def plot_comparison(results: list[dict[str, Any]], out_png: Path, title: str | None = None) -> Path:
    """One panel per headline metric, one bar per run, each bar labelled with its value.

    Separate panels rather than one shared axis: throughput and milliseconds differ by orders of
    magnitude, and a shared scale would flatten the smaller bars to nothing.
    """
    if not results:
        raise ValueError("plot_comparison needs at least one result")
    plt = _pyplot()
    labels = [str(r["label"]) for r in results]
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(results))]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    try:
        for ax, (name, unit, getter, fmt) in zip(axes.flat, _COMPARISON_PANELS, strict=True):
            values = [getter(r["summary"]) for r in results]
            _draw_bars(ax, labels, values, colors, fmt)
            ax.set_title(name)
            ax.set_ylabel(unit)
        fig.suptitle(title if title is not None else "Benchmark comparison")
        fig.tight_layout()
        return _save(fig, out_png)
    finally:
        plt.close(fig)


def plot_overhead(rows: list[dict[str, Any]], baseline_tokens_per_s: float | None, out_png: Path,
                  title: str | None = None) -> Path:
    """Output tokens/s per concurrency level for each side of `shunter bench suite`'s overhead rows, with
    the naive baseline (transformers `generate`, one at a time) as a dashed reference line."""
    plt = _pyplot()
    sides = [("vllm-alone", "AsyncLLM alone"), ("vllm-server", "vLLM OpenAI server"),
             ("ray-serve-llm", "Ray Serve LLM"), ("shunter", "Shunter")]
    sides = [(key, label) for key, label in sides if all(key in row for row in rows)]  # older result files
    fig, ax = plt.subplots(figsize=(9, 4.8))
    try:
        width = 0.8 / len(sides)
        for k, (key, label) in enumerate(sides):
            xs = [i + (k - (len(sides) - 1) / 2) * width for i in range(len(rows))]
            bars = ax.bar(xs, [row[key]["tokens_per_s"] for row in rows], width, label=label)
            ax.bar_label(bars, fmt="%.0f", padding=2, fontsize=8)
        if baseline_tokens_per_s:
            ax.axhline(baseline_tokens_per_s, linestyle="--", color="gray",
                       label=f"transformers generate, one at a time ({baseline_tokens_per_s:.0f})")
        ax.set_xticks(range(len(rows)), [f"{row['concurrency']} stream{'s' if row['concurrency'] != 1 else ''}" for row in rows])
        ax.set_ylabel("output tokens/s")
        ax.margins(y=0.15)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
        ax.set_title(title if title is not None else "Platform overhead: same prompts, engine settings and cores")
        fig.tight_layout()
        return _save(fig, out_png)
    finally:
        plt.close(fig)


def _pyplot() -> Any:
    import matplotlib

    # Only choose the backend when pyplot is not loaded yet: switching under an already-running pyplot
    # (a notebook, say) would close the caller's open figures.
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw_cdf(ax: Any, name: str, values_ms: Sequence[float]) -> None:
    ax.set_title(name)
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0.0, 1.02)
    ax.grid(True, alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="gray")
        return
    xs = sorted(values_ms)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    # Start the step at (first value, 0) so the curve visibly rises from zero.
    ax.step([xs[0], *xs], [0.0, *ys], where="post")
    ax.text(0.98, 0.04, f"n = {len(xs)}", transform=ax.transAxes, ha="right", va="bottom", color="gray")


def _draw_bars(ax: Any, labels: list[str], values: list[float | None], colors: list[Any], fmt: str) -> None:
    positions = list(range(len(labels)))
    bars = ax.bar(positions, [v if v is not None else 0.0 for v in values], color=colors)
    ax.bar_label(bars, labels=[format(v, fmt) if v is not None else "n/a" for v in values], padding=2)
    ax.set_xticks(positions, labels, rotation=20 if len(labels) > 3 else 0)
    ax.margins(y=0.15)  # headroom so the value labels stay inside the axes
    ax.grid(True, axis="y", alpha=0.3)


def _save(fig: Any, out_png: Path) -> Path:
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png", dpi=110)
    return out_png


def _ms(section: str, key: str) -> Callable[[dict[str, Any]], float | None]:
    def get(summary: dict[str, Any]) -> float | None:
        value = summary[section][key]
        return None if value is None else value * _MS

    return get


_COMPARISON_PANELS: list[tuple[str, str, Callable[[dict[str, Any]], float | None], str]] = [
    ("Output throughput", "tokens/s", lambda s: s["output_tokens_per_s"], ".1f"),
    ("Request throughput", "requests/s", lambda s: s["requests_per_s"], ".2f"),
    ("TTFT p50", "ms", _ms("ttft_s", "p50"), ".1f"),
    ("TTFT p99", "ms", _ms("ttft_s", "p99"), ".1f"),
    ("ITL p50", "ms", _ms("itl_s", "p50"), ".1f"),
    ("Goodput", "fraction of requests", lambda s: s["goodput"]["fraction"], ".3f"),
]
