"""`shunter bench placement`, run as an operator runs it, on a small simulated cluster: it places every
layout, writes its result file and its report, and Shunter's stage-first reservation never splits a
tensor-parallel stage across nodes (the claim the report makes; the PACK side's counts are measurements).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.local_app import ROOT

pytestmark = pytest.mark.own_cluster

TRIALS = 2


@pytest.mark.timeout(240)
def test_the_placement_benchmark_runs_and_the_stage_first_side_never_splits_a_stage(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "shunter.cli", "bench", "placement", "--nodes", "3", "--gpus-per-node", "8",
         "--trials", str(TRIALS), "--seed", "1", "--results", str(tmp_path / "results"),
         "--docs", str(tmp_path / "docs")],
        cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "results" / "placement.json").read_text())
    rows = result["rows"]
    assert [(r["tp"], r["pp"]) for r in rows] == [(2, 2), (4, 2), (8, 2)]
    for row in rows:
        assert row["trials"] == TRIALS
        assert row["staged_split"] == 0, f"a stage-first placement split a stage: {row}"
    assert sum(r["trials"] - r["staged_unplaced"] for r in rows) > 0, "the stage-first side placed nothing"
    report = (tmp_path / "docs" / "benchmarks-placement.md").read_text()
    assert f"| TP 8 x PP 2 | {TRIALS} |" in report and report.strip() in done.stdout
