"""CPU core claims: disjoint across replicas of a node, released when the holder goes away."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from shunter.cpu_cores import CoreClaim, NotEnoughCores, claim_cores, cores_per_replica


def test_claims_are_disjoint_and_exhaust(tmp_path):
    a = claim_cores(2, lock_dir=tmp_path, candidates=[0, 1, 2, 3])
    b = claim_cores(2, lock_dir=tmp_path, candidates=[0, 1, 2, 3])
    assert a.cores == [0, 1] and b.cores == [2, 3]
    with pytest.raises(NotEnoughCores, match="needed 1 free cores"):
        claim_cores(1, lock_dir=tmp_path, candidates=[0, 1, 2, 3])
    a.release()
    assert claim_cores(1, lock_dir=tmp_path, candidates=[0, 1, 2, 3]).cores == [0]


def test_failed_claim_holds_nothing(tmp_path):
    with pytest.raises(NotEnoughCores):
        claim_cores(3, lock_dir=tmp_path, candidates=[0, 1])
    assert claim_cores(2, lock_dir=tmp_path, candidates=[0, 1]).cores == [0, 1]


def test_cores_of_a_dead_process_are_free_again(tmp_path):
    """The kernel drops a flock when its process exits: a crashed replica never leaks cores."""
    code = textwrap.dedent(f"""
        from pathlib import Path
        from shunter.cpu_cores import claim_cores
        c = claim_cores(2, lock_dir=Path({str(tmp_path)!r}), candidates=[0, 1])
        print(c.cores)
    """)  # exits without release()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[0, 1]"
    assert claim_cores(2, lock_dir=tmp_path, candidates=[0, 1]).cores == [0, 1]


def test_omp_bind_strings():
    claim = CoreClaim(cores=[2, 3, 4, 5])
    assert claim.omp_bind() == "2,3,4,5"
    assert claim.omp_bind(ranks=2) == "2,3|4,5"
    with pytest.raises(NotEnoughCores):
        CoreClaim(cores=[0]).omp_bind(ranks=2)


def test_auto_split():
    assert cores_per_replica(2, 1) == 2  # alone: all of them
    assert cores_per_replica(2, 2) == 1  # two engines: one each
    assert cores_per_replica(2, 3) == 1  # never zero
    assert cores_per_replica(16, 3) == 5
