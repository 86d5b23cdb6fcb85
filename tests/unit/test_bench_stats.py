"""Benchmark statistics, plots and comparison tables, checked against hand-computed numbers."""

from __future__ import annotations

import json
import random

import pytest

from shunter.bench.compare import compare_table
from shunter.bench.plots import plot_comparison, plot_latency_cdfs
from shunter.bench.records import RequestRecord
from shunter.bench.stats import distribution, percentile, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ok(index, ttft, e2e, itl, prompt, output):
    return RequestRecord(index=index, start_s=0.1 * index, ok=True, status=200, prompt_tokens=prompt,
                         output_tokens=output, ttft_s=ttft, e2e_s=e2e, itl_s=list(itl))


def _failed(index, status, **kw):
    return RequestRecord(index=index, start_s=0.1 * index, ok=False, status=status, error="boom", **kw)


def _records():
    """Four successes (A-D) and four failures; the 503 streamed a little before breaking."""
    return [
        _ok(0, ttft=0.1, e2e=0.5, itl=[0.1, 0.1, 0.1, 0.1], prompt=10, output=5),  # A: TPOT 0.1
        _ok(1, ttft=0.3, e2e=0.9, itl=[0.2, 0.4], prompt=20, output=3),  # B: TPOT 0.3
        _ok(2, ttft=0.2, e2e=0.2, itl=[], prompt=30, output=1),  # C: no gaps
        _ok(3, ttft=0.4, e2e=0.45, itl=[0.05], prompt=40, output=2),  # D: TPOT 0.05
        _failed(4, 429),
        _failed(5, 503, prompt_tokens=7, output_tokens=50, ttft_s=0.01, e2e_s=0.02, itl_s=[0.01]),
        _failed(6, None),
        _failed(7, 429),
    ]


# --- percentile / distribution -----------------------------------------------------------------------


def test_percentile_hand_computed():
    values = [4, 1, 3, 2]  # unsorted on purpose
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1
    assert percentile(values, 100) == 4
    assert percentile(values, 25) == pytest.approx(1.75)  # rank 0.75 between 1 and 2
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7 between 3 and 4
    assert percentile([7.5], 0) == percentile([7.5], 99) == percentile([7.5], 100) == 7.5
    assert percentile([10, 20], 10) == pytest.approx(11.0)


@pytest.mark.parametrize("q", [-0.1, 100.1, float("nan")])
def test_percentile_rejects_q_out_of_range(q):
    with pytest.raises(ValueError):
        percentile([1, 2, 3], q)


def test_percentile_rejects_empty():
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101):
        values = [rng.uniform(0, 5) for _ in range(n)]
        for q in (0, 1, 33.3, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-12)


def test_distribution():
    assert distribution([]) == {"p50": None, "p90": None, "p99": None, "mean": None, "count": 0}
    d = distribution([1.0, 2.0, 3.0, 4.0])
    assert d["count"] == 4
    assert d["mean"] == 2.5
    assert d["p50"] == 2.5
    assert d["p90"] == pytest.approx(3.7)
    assert d["p99"] == pytest.approx(3.97)


# --- summarize ------------------------------------------------------------------------------------


def test_summarize_counts_and_throughput():
    s = summarize(_records(), duration_s=2.0)
    assert s["requests"] == 8
    assert s["succeeded"] == 4
    assert s["failed"] == 4
    assert s["success_rate"] == 0.5
    assert s["errors_by_status"] == {"429": 2, "503": 1, "transport": 1}
    assert s["duration_s"] == 2.0
    assert s["requests_per_s"] == 2.0
    assert s["output_tokens"] == 11  # the failed 503's 50 tokens do not count
    assert s["output_tokens_per_s"] == 5.5
    assert s["prompt_tokens"] == 100
    json.dumps(s)  # must be JSON-serializable as is


def test_summarize_latency_distributions():
    s = summarize(_records(), duration_s=2.0)
    ttft = s["ttft_s"]  # [0.1, 0.2, 0.3, 0.4]; the failed request's 0.01 is excluded
    assert ttft["count"] == 4
    assert ttft["p50"] == pytest.approx(0.25)
    assert ttft["p90"] == pytest.approx(0.37)
    assert ttft["p99"] == pytest.approx(0.397)
    assert ttft["mean"] == pytest.approx(0.25)

    itl = s["itl_s"]  # pooled: [0.05, 0.1, 0.1, 0.1, 0.1, 0.2, 0.4]
    assert itl["count"] == 7
    assert itl["p50"] == pytest.approx(0.1)
    assert itl["p99"] == pytest.approx(0.388)
    assert itl["mean"] == pytest.approx(1.05 / 7)

    tpot = s["tpot_s"]  # per-request means of A, B, D: [0.1, 0.3, 0.05]; C has no gaps
    assert tpot["count"] == 3
    assert tpot["p50"] == pytest.approx(0.1)
    assert tpot["mean"] == pytest.approx(0.15)

    e2e = s["e2e_s"]  # [0.2, 0.45, 0.5, 0.9]
    assert e2e["count"] == 4
    assert e2e["p50"] == pytest.approx(0.475)


@pytest.mark.parametrize(
    ("slo_ttft_s", "slo_itl_s", "meeting"),
    [
        (None, None, 4),  # every success
        (0.2, None, 2),  # A, C (C's 0.2 is inclusive)
        (None, 0.2, 3),  # A, C (no gaps), D; B's TPOT 0.3 misses
        (0.35, 0.2, 2),  # TTFT admits A, B, C; ITL admits A, C, D; both: A, C
        (0.01, None, 0),  # the failed 503 had a 0.01 TTFT but failures never count
    ],
)
def test_summarize_goodput(slo_ttft_s, slo_itl_s, meeting):
    g = summarize(_records(), duration_s=2.0, slo_ttft_s=slo_ttft_s, slo_itl_s=slo_itl_s)["goodput"]
    assert g["slo_ttft_s"] == slo_ttft_s
    assert g["slo_itl_s"] == slo_itl_s
    assert g["requests_meeting_slo"] == meeting
    assert g["fraction"] == meeting / 8  # over all requests, failures included
    assert g["requests_per_s"] == meeting / 2.0


def test_summarize_no_records():
    s = summarize([], duration_s=1.0)
    assert s["requests"] == 0 and s["success_rate"] == 0.0 and s["errors_by_status"] == {}
    assert s["ttft_s"]["count"] == 0 and s["ttft_s"]["p50"] is None
    assert s["goodput"]["fraction"] == 0.0


@pytest.mark.parametrize("duration", [0, 0.0, -1.0, float("nan"), float("inf")])
def test_summarize_rejects_bad_duration(duration):
    with pytest.raises(ValueError):
        summarize(_records(), duration_s=duration)


def test_summarize_rejects_negative_slo():
    with pytest.raises(ValueError):
        summarize(_records(), duration_s=1.0, slo_ttft_s=-0.1)


# --- plots ---------------------------------------------------------------------------------------


def _result(label, records, duration_s=2.0):
    return {"label": label, "requests": [r.to_json() for r in records],
            "summary": summarize(records, duration_s=duration_s, slo_ttft_s=0.35, slo_itl_s=0.2)}


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1000


def test_plot_latency_cdfs(tmp_path):
    out = tmp_path / "nested" / "dir" / "cdf.png"  # parent directories are created
    assert plot_latency_cdfs(_result("base", _records()), out, title="CDFs") == out
    _assert_png(out)


def test_plot_latency_cdfs_no_data(tmp_path):
    out = plot_latency_cdfs(_result("all failed", [_failed(0, 503), _failed(1, None)]), tmp_path / "empty.png")
    _assert_png(out)


def test_plot_comparison(tmp_path):
    import matplotlib.pyplot as plt

    results = [_result("base", _records()), _result("faster", _records(), duration_s=1.0),
               _result("broken", [_failed(0, 503)])]  # None latencies draw as "n/a"
    out = plot_comparison(results, tmp_path / "cmp" / "compare.png", title="base vs faster")
    assert out == tmp_path / "cmp" / "compare.png"
    _assert_png(out)
    assert plt.get_fignums() == []  # figures are closed, not leaked


def test_plot_comparison_rejects_empty(tmp_path):
    with pytest.raises(ValueError):
        plot_comparison([], tmp_path / "x.png")


# --- compare_table -------------------------------------------------------------------------------


def _row(table, name):
    line = next(line for line in table.splitlines() if line.startswith(name + " "))
    return line[len(name):].split()


def test_compare_table_two_results():
    table = compare_table([_result("base", _records()), _result("faster", _records(), duration_s=1.0)])
    header = table.splitlines()[0]
    assert header.split()[:3] == ["metric", "base", "faster"]
    assert header.rstrip().endswith("ratio vs base")
    assert _row(table, "requests") == ["8", "8", "1.00x"]
    assert _row(table, "success rate") == ["0.500", "0.500", "1.00x"]
    assert _row(table, "output tok/s") == ["5.5", "11.0", "2.00x"]
    assert _row(table, "requests/s") == ["2.00", "4.00", "2.00x"]
    assert _row(table, "TTFT p50 (ms)") == ["250.0", "250.0", "1.00x"]
    assert _row(table, "TTFT p99 (ms)") == ["397.0", "397.0", "1.00x"]
    assert _row(table, "ITL p99 (ms)") == ["388.0", "388.0", "1.00x"]
    assert _row(table, "E2E p50 (ms)") == ["475.0", "475.0", "1.00x"]
    assert _row(table, "goodput fraction") == ["0.250", "0.250", "1.00x"]
    # Aligned: numbers are right-aligned in fixed-width columns, so every line has the same length.
    assert len({len(line) for line in table.splitlines()}) == 1


def test_compare_table_undefined_ratios_and_many_results():
    broken = _result("broken", [_failed(0, 503)])
    table = compare_table([broken, _result("base", _records()), _result("fast", _records(), duration_s=1.0)])
    header = table.splitlines()[0]
    assert "base ratio vs broken" in header and "fast ratio vs broken" in header
    assert _row(table, "TTFT p50 (ms)") == ["-", "250.0", "250.0", "-", "-"]  # no baseline value
    assert _row(table, "output tok/s") == ["0.0", "5.5", "11.0", "-", "-"]  # baseline zero
    assert _row(table, "requests") == ["1", "8", "8", "8.00x", "8.00x"]


def test_compare_table_single_result_has_no_ratio_column():
    table = compare_table([_result("only", _records())])
    assert "ratio" not in table
    assert _row(table, "output tok/s") == ["5.5"]


def test_plot_overhead_writes_a_png(tmp_path):
    from shunter.bench.plots import plot_overhead

    def side(tps):
        return {"tokens_per_s": tps, "ttft_p50_s": 0.1}

    rows = [{"concurrency": c, "vllm-alone": side(10.0 * c), "vllm-server": side(9.0 * c), "shunter": side(8.0 * c)}
            for c in (1, 8, 32)]
    out = plot_overhead(rows, 20.0, tmp_path / "img" / "overhead.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
