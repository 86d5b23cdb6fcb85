"""Admission control: turn new requests away (429) before a model's queue grows without end.

One gate per model per gateway process. A request is admitted when the requests this gateway already
admitted for the model, and not yet finished, fit in what the running replicas take at once
(`capacity`: replicas x max_ongoing_requests, this gateway's share) plus the configured queue bound.
Otherwise it is refused at once with a Retry-After estimated from how fast admitted requests have
been finishing, so a client backs off about as long as the queue ahead of it takes to clear.

Requests already admitted are never touched: the gate only ever decides about the request at the door.

Why not Ray Serve's own `max_queued_requests`: Ray counts requests its router has not yet assigned to a
replica, and a burst is counted before routing catches up, so it refuses requests that free replica
slots could have served (Ray's router says as much in its source); its Retry-After is a fixed number.
This gate counts admitted work against known capacity, so a burst that fits is admitted whole.

Admitted requests beyond what the replicas take at once wait in the gateway (`DispatchQueue`), in
arrival order, and go to Ray's request router only when a slot frees. Left in Ray's router instead,
that backlog made the router probe the replicas' queue lengths over and over for requests it could not
place (measured: 44% of a saturated gateway's samples), CPU the engines then lacked, and the backlog
started in no particular order.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable

DEFAULT_RETRY_AFTER_S = 5
MAX_RETRY_AFTER_S = 60
MIN_FINISHES_FOR_RATE = 8  # finishes in the window before the wait bound trusts the rate


class AdmissionGate:
    def __init__(self, max_queued: int, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.max_queued = max_queued
        self.window_s = window_s
        self.clock = clock
        self.admitted = 0
        self._finished: deque[float] = deque()  # when recent admitted requests finished

    def try_admit(self, capacity: int, max_wait_s: float = math.inf, weight: int = 1) -> int | None:
        """Admit one request (None), or refuse it: the seconds a client should wait before retrying. It is
        refused past the count bound, and when it would wait for a slot longer than `max_wait_s` as far
        as the recent finish rate tells (no rate yet: the count alone decides).

        `weight`: the engine requests it makes (a batch of embedding inputs or completion prompts, times
        `n`): it counts as that many (`admitted_weight` says how many it took; release that many). A batch
        larger than the whole bound counts as the whole bound, so an idle model still takes it, alone."""
        bound = max(0, capacity) + self.max_queued
        weight = self.admitted_weight(capacity, weight)
        if self.admitted + weight > bound:
            return self.retry_after_s(capacity)
        wait = self.expected_wait_s(capacity)
        if wait is not None and wait > max_wait_s:
            return self.retry_after_s(capacity)
        self.admitted += weight
        return None

    def admitted_weight(self, capacity: int, weight: int) -> int:
        """What a request of `weight` engine requests counts for at this gate (at least 1, at most the bound)."""
        return max(1, min(weight, max(0, capacity) + self.max_queued))

    def expected_wait_s(self, capacity: int) -> float | None:
        """How long a request admitted now would wait for a slot: 0 while there is room, else the requests
        ahead of it over the rate admitted requests finish; None while too few finished to tell."""
        ahead = self.admitted - max(0, capacity)
        if ahead < 0:
            return 0.0
        self._expire()
        if len(self._finished) < MIN_FINISHES_FOR_RATE:
            return None
        span = max(1.0, self.clock() - self._finished[0])
        return (ahead + 1) / (len(self._finished) / span)

    def release(self, weight: int = 1) -> None:
        """An admitted request finished, however it ended (`weight`: what it was admitted as)."""
        self.admitted = max(0, self.admitted - weight)
        self._finished.extend([self.clock()] * weight)
        self._expire()

    def queued(self, capacity: int) -> int:
        """Admitted requests beyond what the running replicas take at once."""
        return max(0, self.admitted - max(0, capacity))

    def finish_rate(self) -> float:
        """Admitted requests finished per second over the recent window."""
        self._expire()
        return len(self._finished) / self.window_s

    def retry_after_s(self, capacity: int) -> int:
        rate = self.finish_rate()
        if rate <= 0:
            return DEFAULT_RETRY_AFTER_S
        ahead = self.queued(capacity) + 1  # the queue, and this request
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(ahead / rate)))

    def _expire(self) -> None:
        horizon = self.clock() - self.window_s
        while self._finished and self._finished[0] < horizon:
            self._finished.popleft()


class DispatchQueue:
    """When an admitted request may go to the replicas: at most `capacity()` at once from this gateway
    (and always at least one, so a model scaled to zero still gets the request whose arrival at Ray's
    router starts a replica), the others waiting here in arrival order. A request that got its turn
    holds it until it ends (`leave`). Capacity that grows without a request ending (a replica started)
    is noticed every `tick_s` while requests wait."""

    def __init__(self, capacity: Callable[[], int], tick_s: float = 0.25):
        self.capacity = capacity
        self.tick_s = tick_s
        self.dispatched = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._ticking = False

    @property
    def depth(self) -> int:
        """Requests waiting for their turn."""
        return sum(1 for turn in self._waiting if not turn.done())

    async def enter(self, timeout_s: float) -> bool:
        """Wait for this request's turn: True once it may go, False after `timeout_s` (it then holds
        nothing). A request cancelled while it waits holds nothing either."""
        self._pump()  # drops turns given up, so a queue of only those is no queue
        if not self._waiting and self.dispatched < self._room():
            self.dispatched += 1
            return True
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        self._tick()
        try:
            async with asyncio.timeout(timeout_s):
                await turn
            return True
        except TimeoutError:
            if turn.done() and not turn.cancelled():  # its turn came as the time ran out: it holds it
                return True
            turn.cancel()
            self._pump()
            return False
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.leave()
            else:
                turn.cancel()
                self._pump()
            raise

    def leave(self) -> None:
        """A request that had its turn ended, however it ended."""
        self.dispatched = max(0, self.dispatched - 1)
        self._pump()

    def _room(self) -> int:
        return max(1, self.capacity())

    def _pump(self) -> None:
        room = self._room()
        while self._waiting and self.dispatched < room:
            turn = self._waiting.popleft()
            if not turn.done():  # a waiter that gave up leaves its cancelled turn behind
                turn.set_result(None)
                self.dispatched += 1
        while self._waiting and self._waiting[0].done():
            self._waiting.popleft()

    def _tick(self) -> None:
        if self._ticking:
            return
        self._ticking = True

        def tick() -> None:
            self._ticking = False
            self._pump()
            if self._waiting:
                self._tick()

        asyncio.get_running_loop().call_later(self.tick_s, tick)
