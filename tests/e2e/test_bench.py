"""`shunter bench` against the live app: every request accounted for, the result file consistent."""

from __future__ import annotations

import json

from shunter.bench.runner import main_compare, main_run

from .live import CHAT_MODEL


def _run(live_app, tmp_path, name: str, *options: str) -> dict:
    out = tmp_path / f"{name}.json"
    code = main_run(["--base-url", live_app.v1, "--model", CHAT_MODEL, "--out", str(out), "--quiet",
                     "--label", name, *options])
    assert code == 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(out.read_text())


def _assert_consistent(result: dict, expected_requests: int) -> None:
    summary, records = result["summary"], result["requests"]
    assert len(records) == summary["requests"] == expected_requests, "every request is accounted for"
    assert sorted(r["index"] for r in records) == list(range(expected_requests))
    assert summary["succeeded"] == expected_requests and summary["failed"] == 0
    assert summary["errors_by_status"] == {}
    assert summary["output_tokens"] == sum(r["output_tokens"] for r in records)
    assert all(r["ok"] and r["status"] == 200 and r["ttft_s"] is not None for r in records)
    assert all(r["ttft_s"] <= r["e2e_s"] for r in records)
    assert summary["ttft_s"]["count"] == expected_requests
    assert summary["ttft_s"]["p50"] <= summary["ttft_s"]["p99"]
    for key in ("date", "commit", "machine", "options", "workload"):
        assert result[key], key


def test_random_workload_at_fixed_concurrency(live_app, tmp_path):
    result = _run(live_app, tmp_path, "random", "--workload", "random", "--requests", "12", "--concurrency", "4",
                  "--input-len", "uniform:16:64", "--output-len", "fixed:12", "--slo-ttft-ms", "60000")
    _assert_consistent(result, 12)
    # ignore_eos makes the server honour the workload's output lengths exactly
    assert all(r["output_tokens"] == 12 for r in result["requests"])
    assert result["summary"]["goodput"]["requests_meeting_slo"] == 12


def test_shared_prefix_and_multi_turn_and_compare(live_app, tmp_path, capsys):
    shared = _run(live_app, tmp_path, "shared", "--workload", "shared-prefix", "--groups", "2", "--users", "3",
                  "--system-len", "256", "--output-len", "fixed:4", "--concurrency", "3")
    _assert_consistent(shared, 6)
    assert shared["workload"]["groups"] == 2
    # the server saw each long shared system prompt in every request of its group
    assert min(r["prompt_tokens"] for r in shared["requests"]) > 256

    chat = _run(live_app, tmp_path, "multi", "--workload", "multi-turn", "--conversations", "2", "--turns", "3",
                "--turn-len", "fixed:10", "--output-len", "fixed:6", "--concurrency", "2")
    _assert_consistent(chat, 6)
    # later turns resend the history, so the server sees longer prompts
    assert max(r["prompt_tokens"] for r in chat["requests"]) > min(r["prompt_tokens"] for r in chat["requests"])

    assert main_compare([str(tmp_path / "shared.json"), str(tmp_path / "multi.json"),
                         "--plot", str(tmp_path / "cmp.png")]) == 0
    table = capsys.readouterr().out
    assert "shared" in table and "multi" in table
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"


def test_poisson_arrivals_for_a_duration(live_app, tmp_path):
    result = _run(live_app, tmp_path, "poisson", "--workload", "random", "--rate", "4", "--duration", "3",
                  "--input-len", "fixed:16", "--output-len", "fixed:4", "--endpoint", "completions")
    n = result["summary"]["requests"]
    assert 1 <= n <= 40  # about 12 expected; Poisson, so bounds only
    _assert_consistent(result, n)
