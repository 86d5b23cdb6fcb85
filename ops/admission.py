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
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

DEFAULT_RETRY_AFTER_S = 5
MAX_RETRY_AFTER_S = 60


class AdmissionGate:
    def __init__(self, max_queued: int, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.max_queued = max_queued
        self.window_s = window_s
        self.clock = clock
        self.admitted = 0
        self._finished: deque[float] = deque()  # when recent admitted requests finished

    def try_admit(self, capacity: int) -> int | None:
        """Admit one request (None), or refuse it: the seconds a client should wait before retrying."""
        if self.admitted < max(0, capacity) + self.max_queued:
            self.admitted += 1
            return None
        return self.retry_after_s(capacity)

    def release(self) -> None:
        """An admitted request finished, however it ended."""
        if self.admitted > 0:
            self.admitted -= 1
        self._finished.append(self.clock())
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
