"""`shunter bench contention --batch`'s pure parts: the batch file it submits and its report's arithmetic."""

from __future__ import annotations

import json

import pytest

from shunter.cli.bench_batch import batch_lines, report

pytestmark = pytest.mark.unit


def test_the_batch_file_is_one_fixed_length_request_per_line():
    rows = [json.loads(line) for line in batch_lines("m", 3, 16).splitlines()]
    assert [r["custom_id"] for r in rows] == ["r0", "r1", "r2"]
    assert {r["url"] for r in rows} == {"/v1/chat/completions"} and {r["method"] for r in rows} == {"POST"}
    assert all(r["body"]["max_tokens"] == 16 and r["body"]["ignore_eos"] for r in rows)
    assert len({r["body"]["messages"][0]["content"] for r in rows}) == 3  # no two lines the same request


def _shot(ttft_s: float, status: int = 200) -> dict:
    return {"status": status, "sent_s": 1.0, "first_s": 1.0 + ttft_s}


def test_the_report_compares_p99s_and_throughputs_of_the_same_run():
    result = {"cpu": {"model": "Test CPU", "isa": ["avx2"]}, "machine": {"cpus": 2},
              "light_alone": [_shot(0.1)] * 99 + [_shot(0.2)], "options": {"lines": 2000},
              "light_beside_batch": [_shot(0.12)] * 99 + [_shot(0.3), _shot(9.0, status=429)],
              "idle_batch": {"completed": 400}, "idle_batch_tok_s": 90.0, "closed_loop_tok_s": 100.0,
              "concurrency": 8}
    text = report(result)
    assert "Test CPU, 2 cores; ISA: avx2" in text
    assert "| alone | 100/100 |" in text and "| beside a 2000-line batch | 100/101 |" in text
    assert "batch / closed loop: 0.90 (goal >= 0.9)" in text
    ratio = float(text.split("TTFT p99 beside the batch / alone: ")[1].split("x")[0])
    assert 1.0 < ratio < 1.6  # the 429 is not an answer: its 9 s counts nowhere
