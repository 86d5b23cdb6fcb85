"""Retry-once failover: a request whose replica failed before anything reached the client goes once
more, to another replica. After the first byte went out nothing is retried (the client would see two
answers spliced together); the gateway ends such a stream with an error event instead.

The caller supplies one attempt as a function of the replicas to avoid; an attempt raises
`ReplicaFailure` for the replica's own faults (engine error, death, silence) and returns normally for
everything else, including a client's 4xx, which is an answer, not a failure.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class ReplicaFailure(Exception):
    """The replica that took the request failed it before the first byte reached the client."""

    def __init__(self, replica: str, why: str):
        super().__init__(f"replica {replica}: {why}")
        self.replica = replica
        self.why = why


async def with_failover(
    attempt: Callable[[tuple[str, ...]], Awaitable[T]],
    retry_once: bool,
    on_failure: Callable[[ReplicaFailure], None],
) -> T:
    """Run `attempt(avoid=())`; on a ReplicaFailure report it and, if allowed, run it once more
    avoiding that replica. The second failure (or the first, without retry) propagates."""
    try:
        return await attempt(())
    except ReplicaFailure as failure:
        on_failure(failure)
        if not retry_once:
            raise
        avoid = (failure.replica,)
    try:
        return await attempt(avoid)
    except ReplicaFailure as failure:
        on_failure(failure)
        raise
