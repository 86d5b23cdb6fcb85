"""Retry-once failover: a replica's own failure is retried once elsewhere; nothing else is retried."""

from __future__ import annotations

import asyncio

import pytest

from shunter.routing.failover import ReplicaFailure, with_failover


class Attempts:
    """An attempt function that plays back `outcomes` (a value to return or an exception to raise)."""

    def __init__(self, *outcomes):
        self.outcomes = list(outcomes)
        self.avoided: list[tuple[str, ...]] = []

    async def __call__(self, avoid: tuple[str, ...]):
        self.avoided.append(avoid)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def _run(attempt, retry_once=True):
    failures: list[ReplicaFailure] = []
    result = asyncio.run(with_failover(attempt, retry_once, failures.append))
    return result, failures


def test_success_first_time_runs_one_attempt_avoiding_nothing():
    attempt = Attempts("ok")
    assert _run(attempt) == ("ok", [])
    assert attempt.avoided == [()]


def test_a_replica_failure_is_reported_and_retried_avoiding_that_replica():
    first = ReplicaFailure("r1", "engine error")
    attempt = Attempts(first, "ok")
    result, failures = _run(attempt)
    assert result == "ok" and failures == [first]
    assert attempt.avoided == [(), ("r1",)]


def test_a_second_failure_is_reported_and_propagates():
    first, second = ReplicaFailure("r1", "died"), ReplicaFailure("r2", "hung")
    attempt, failures = Attempts(first, second), []
    with pytest.raises(ReplicaFailure) as info:
        asyncio.run(with_failover(attempt, True, failures.append))
    assert info.value is second and failures == [first, second]
    assert attempt.avoided == [(), ("r1",)]


def test_without_retry_the_first_failure_propagates():
    first = ReplicaFailure("r1", "died")
    attempt, failures = Attempts(first, "never"), []
    with pytest.raises(ReplicaFailure) as info:
        asyncio.run(with_failover(attempt, False, failures.append))
    assert info.value is first and failures == [first] and attempt.avoided == [()]


def test_other_exceptions_are_not_retried_or_reported():
    attempt, failures = Attempts(ValueError("bad request"), "never"), []
    with pytest.raises(ValueError, match="bad request"):
        asyncio.run(with_failover(attempt, True, failures.append))
    assert failures == [] and attempt.avoided == [()]


def test_a_non_replica_error_on_the_retry_propagates_unreported():
    first = ReplicaFailure("r1", "died")
    attempt, failures = Attempts(first, RuntimeError("gateway bug")), []
    with pytest.raises(RuntimeError):
        asyncio.run(with_failover(attempt, True, failures.append))
    assert failures == [first]


def test_replica_failure_names_the_replica_and_why():
    failure = ReplicaFailure("r9", "stopped answering")
    assert failure.replica == "r9" and failure.why == "stopped answering"
    assert "r9" in str(failure) and "stopped answering" in str(failure)
