"""`shunter bench builds` without Ray or engines: the flags, the labels, the interleaved order, the
medians and ratios to the baseline, the table, and that the child's code names only what it imports."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from shunter.cli import bench_builds as bb

pytestmark = pytest.mark.unit

A, B = "4b75a6d", "HEAD (cc9b414)"


def _sample(build: str, rnd: int, level: int, tps: float, ttft: float, cpu: float | None) -> dict:
    return {"build": build, "round": rnd, "concurrency": level, "tokens_per_s": tps, "ttft_p50_s": ttft,
            "serving_cpu_ms_per_1k": cpu}


SAMPLES = [
    _sample(A, 1, 1, 10.0, 0.100, 400.0), _sample(B, 1, 1, 9.0, 0.120, 420.0),
    _sample(A, 2, 1, 12.0, 0.110, 500.0), _sample(B, 2, 1, 12.0, 0.100, 460.0),
    _sample(A, 3, 1, 11.0, 0.090, 450.0), _sample(B, 3, 1, 13.0, 0.110, 900.0),
    _sample(A, 1, 8, 40.0, 0.300, 200.0), _sample(B, 1, 8, 20.0, 0.600, None),
]


def test_flags_and_their_defaults():
    args = bb.parse_args(["4b75a6d", "HEAD"])
    assert args.refs == ["4b75a6d", "HEAD"] and args.rounds == 2 and args.levels == [1, 8, 32]
    assert args.max_tokens == 64 and args.config == Path("configs/local.yaml") and not args.own_config
    assert args.model == "smollm2-135m-instruct" and args.out == Path("results/builds.json")
    args = bb.parse_args(["HEAD", "--rounds", "5", "--concurrency", "4,16", "--max-tokens", "8", "--own-config",
                          "--out", "/tmp/x.json"])
    assert (args.rounds, args.levels, args.max_tokens, args.own_config, args.out) == (5, [4, 16], 8, True,
                                                                                      Path("/tmp/x.json"))


@pytest.mark.parametrize("argv", [[], ["HEAD", "--rounds", "0"], ["HEAD", "--concurrency", "1,0"],
                                  ["HEAD", "--concurrency", "a"]])
def test_bad_flags_are_refused(argv):
    with pytest.raises(SystemExit):
        bb.parse_args(argv)


def test_labels_name_the_commit_and_tell_repeats_apart():
    sha1, sha2 = "4b75a6dc6f0fe97ee00199b8df690a32e5a80dd0", "cc9b414" + "0" * 33
    assert bb.build_labels(["4b75a6d", "HEAD", "HEAD", "main"], [sha1, sha2, sha2, sha2]) == [
        "4b75a6d", "HEAD (cc9b414)", "HEAD (cc9b414) #2", "main (cc9b414)"]
    assert bb.build_labels(["4B75A6DC6F", "HEAD", "HEAD", "HEAD"], [sha1, sha2, sha2, sha2]) == [
        "4b75a6d", "HEAD (cc9b414)", "HEAD (cc9b414) #2", "HEAD (cc9b414) #3"]
    assert bb.build_labels(["abc"], ["abcdef" + "0" * 34]) == ["abc (abcdef0)"]  # too short to be a commit


def test_rounds_are_interleaved_build_by_build():
    assert bb.schedule(["a", "b", "c"], 2) == [(1, "a"), (1, "b"), (1, "c"), (2, "a"), (2, "b"), (2, "c")]
    assert bb.schedule(["a"], 3) == [(1, "a"), (2, "a"), (3, "a")]


def test_medians_over_rounds_and_ratios_to_the_first_build():
    rows = bb.aggregate(SAMPLES, [A, B])
    assert [r["concurrency"] for r in rows] == [1, 8]
    a, b = rows[0]["builds"][A], rows[0]["builds"][B]
    assert (a["rounds"], a["tokens_per_s"], a["ttft_p50_s"], a["serving_cpu_ms_per_1k"]) == (3, 11.0, 0.100, 450.0)
    assert (b["tokens_per_s"], b["ttft_p50_s"], b["serving_cpu_ms_per_1k"]) == (12.0, 0.110, 460.0)
    assert b["tokens_per_s_rounds"] == [9.0, 12.0, 13.0]
    assert b["tokens_per_s_vs_base"] == pytest.approx(12.0 / 11.0)
    assert b["ttft_p50_s_vs_base"] == pytest.approx(1.1)
    assert b["serving_cpu_ms_per_1k_vs_base"] == pytest.approx(460.0 / 450.0)
    assert a["tokens_per_s_vs_base"] == 1.0
    c8 = rows[1]["builds"]
    assert c8[B]["tokens_per_s_vs_base"] == 0.5 and c8[B]["ttft_p50_s_vs_base"] == 2.0
    assert c8[B]["serving_cpu_ms_per_1k"] is None and c8[B]["serving_cpu_ms_per_1k_vs_base"] is None
    assert bb.aggregate(SAMPLES, [B, A])[0]["builds"][A]["tokens_per_s_vs_base"] == pytest.approx(11.0 / 12.0)


def test_table_gives_medians_spread_and_ratios():
    lines = bb.table(bb.aggregate(SAMPLES, [A, B]), [A, B]).splitlines()
    assert lines[0] == (f"| streams | {A} tok/s (±spread, TTFT p50) | {A} CPU ms/1k | {B} tok/s (±spread, TTFT p50) "
                        f"| {B} CPU ms/1k | {B} / {A}: tok/s, TTFT p50, CPU |")
    assert lines[1] == "|---|---|---|---|---|---|"
    # spread: (12 - 10) / 2 / 11 = 9%; (13 - 9) / 2 / 12 = 17%
    assert lines[2] == "| 1 | 11.0 (±9%, 100 ms) | 450 | 12.0 (±17%, 110 ms) | 460 | 1.09, 1.10, 1.02 |"
    assert lines[3] == "| 8 | 40.0 (±-%, 300 ms) | 200 | 20.0 (±-%, 600 ms) | - | 0.50, 2.00, - |"
    assert len(lines) == 4


def test_one_build_has_no_ratio_column():
    lines = bb.table(bb.aggregate([s for s in SAMPLES if s["build"] == A], [A]), [A]).splitlines()
    assert lines[0].count("|") == 4 and lines[2] == "| 1 | 11.0 (±9%, 100 ms) | 450 |"


def test_the_child_imports_only_what_exists():
    tree = ast.parse(bb.CHILD)
    names = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             for alias in node.names]
    assert ("shunter.cli.bench_overhead", "bench_openai_endpoint") in names
    for module, name in names:
        if module.startswith("shunter"):
            assert hasattr(importlib.import_module(module), name), (module, name)
