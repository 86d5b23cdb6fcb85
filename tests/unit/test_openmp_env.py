"""Reading the OpenMP variables vLLM's CPU executor sets for a worker (shunter.openmp_env), in each runtime's
own syntax; what a forked process does with them is tested with the fork server (test_engine_forkserver)."""

from __future__ import annotations

import pytest

from shunter import openmp_env

VARIABLES = ("OMP_NUM_THREADS", "KMP_AFFINITY", "GOMP_CPU_AFFINITY", "OMP_PLACES")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("KMP_AFFINITY", "granularity=fine,explicit,proclist=[2,3]", {2, 3}),
    ("GOMP_CPU_AFFINITY", "0 1 2", {0, 1, 2}),
    ("GOMP_CPU_AFFINITY", "0-6:2 9", {0, 2, 4, 6, 9}),
    ("OMP_PLACES", "{4,5}", {4, 5}),
    ("OMP_PLACES", "cores", None),
    ("GOMP_CPU_AFFINITY", "0 x", None),
    ("GOMP_CPU_AFFINITY", "5-1", None),
    ("KMP_AFFINITY", "granularity=fine,compact", None),
])
def test_the_cores_each_runtimes_variable_names(monkeypatch, name, value, expected):
    monkeypatch.setenv(name, value)
    assert openmp_env.cores() == expected


@pytest.mark.parametrize(("value", "expected"), [("4", 4), ("2,1", 2), ("0", None), ("many", None), ("", None)])
def test_the_thread_count_is_the_outermost_level_and_only_a_positive_one(monkeypatch, value, expected):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert openmp_env.threads() == expected


def test_nothing_named_leaves_the_process_as_it_is(monkeypatch):
    import os

    before = os.sched_getaffinity(0)
    openmp_env.adopt()
    assert os.sched_getaffinity(0) == before
