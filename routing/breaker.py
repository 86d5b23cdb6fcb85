"""Circuit breakers: one per replica, so a failing replica stops getting traffic and is tested back in.

    closed ──(N failures in a row, or error rate ≥ r over the window with enough outcomes)──▶ open
    open ──(cooldown elapsed)──▶ half_open: up to `half_open_probes` requests at once go through
    half_open ──(a probe succeeds)──▶ closed        half_open ──(a probe fails)──▶ open (cooldown again)

Outcomes come from the gateway, which alone sees how a request ended. Only the replica's own failures
count: an engine error (5xx), a replica that died mid-request, one that stopped answering. A client's
4xx is a success for the replica. The clock is injected so the state machine is tested without sleeping.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from enum import Enum

from shunter.config import BreakerConfig


class BreakerState(str, Enum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"

    @property
    def level(self) -> int:
        """Gauge value: 0 closed, 1 half-open, 2 open."""
        return {"closed": 0, "half_open": 1, "open": 2}[self.value]


Transition = Callable[[str, BreakerState, BreakerState, str], None]  # replica, from, to, why


class CircuitBreaker:
    def __init__(self, config: BreakerConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._outcomes: deque[tuple[float, bool]] = deque()  # (time, failed) inside the window
        self._opened_at = 0.0
        self._probes = 0
        self.last_reason = ""

    @property
    def state(self) -> BreakerState:
        """The state now; an open breaker whose cooldown has passed reads as half-open."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.config.cooldown_s:
            self._state, self._probes = BreakerState.HALF_OPEN, 0
            self.last_reason = "cooldown elapsed"
        return self._state

    def retry_after_s(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when not open)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self.config.cooldown_s - (self._clock() - self._opened_at))

    def allows(self) -> bool:
        """May a request be sent now? (Does not take a probe slot; `on_dispatch` does.)"""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        return state is BreakerState.HALF_OPEN and self._probes < self.config.half_open_probes

    def on_dispatch(self) -> bool:
        """A request was sent; True when it took a half-open probe slot (its caller frees it later)."""
        if self.state is BreakerState.HALF_OPEN:
            self._probes += 1
            return True
        return False

    def on_probe_done(self) -> None:
        """A probe ended (whatever the outcome): its slot is free again."""
        if self._state is BreakerState.HALF_OPEN and self._probes > 0:
            self._probes -= 1

    def record(self, failed: bool, why: str = "") -> tuple[BreakerState, BreakerState] | None:
        """Record one outcome; returns (from, to) when the state changed."""
        before, now = self.state, self._clock()
        self._outcomes.append((now, failed))
        while self._outcomes and now - self._outcomes[0][0] > self.config.window_s:
            self._outcomes.popleft()
        self._consecutive = self._consecutive + 1 if failed else 0
        if before is BreakerState.HALF_OPEN:
            if failed:
                return self._open(before, f"probe failed: {why}")
            self._state, self._consecutive, self._outcomes = BreakerState.CLOSED, 0, deque()
            self.last_reason = "probe succeeded"
            return before, BreakerState.CLOSED
        if before is BreakerState.CLOSED and failed:
            if self._consecutive >= self.config.consecutive_failures:
                return self._open(before, f"{self._consecutive} failures in a row, last: {why}")
            failures = sum(1 for _, f in self._outcomes if f)
            if len(self._outcomes) >= self.config.min_requests and \
                    failures / len(self._outcomes) >= self.config.error_rate:
                return self._open(before, f"{failures}/{len(self._outcomes)} failed in {self.config.window_s:g}s")
        return None

    def _open(self, before: BreakerState, reason: str) -> tuple[BreakerState, BreakerState]:
        self._state, self._opened_at, self._probes = BreakerState.OPEN, self._clock(), 0
        self.last_reason = reason
        return before, BreakerState.OPEN


class BreakerBoard:
    """The breakers of one deployment's replicas, as one gateway process sees them."""

    def __init__(self, config: BreakerConfig, clock: Callable[[], float] = time.monotonic,
                 on_transition: Transition | None = None):
        self.config = config
        self._clock = clock
        self._breakers: dict[str, CircuitBreaker] = {}
        self._on_transition = on_transition
        self._seen_state: dict[str, BreakerState] = {}
        # Replica failures recorded per replica since this process started (whatever the breaker did with
        # them): what an operator, or a test of "no client input moves a breaker", reads.
        self.failures: dict[str, int] = {}

    def _get(self, replica: str) -> CircuitBreaker:
        breaker = self._breakers.get(replica)
        if breaker is None:
            breaker = self._breakers[replica] = CircuitBreaker(self.config, self._clock)
            self._seen_state[replica] = BreakerState.CLOSED
        return breaker

    def allows(self, replica: str) -> bool:
        if not self.config.enabled:
            return True
        breaker = self._get(replica)
        allowed = breaker.allows()
        self._notice(replica, breaker)
        return allowed

    def on_dispatch(self, replica: str) -> bool:
        """True when the request took a probe slot: pass it back through `on_probe_done` when it ends."""
        return self._get(replica).on_dispatch() if self.config.enabled else False

    def on_probe_done(self, replica: str) -> None:
        if replica in self._breakers:
            self._breakers[replica].on_probe_done()

    def record(self, replica: str, failed: bool, why: str = "") -> None:
        if not self.config.enabled:
            return
        breaker = self._get(replica)
        if failed:
            self.failures[replica] = self.failures.get(replica, 0) + 1
        change = breaker.record(failed, why)
        if change is not None:
            before, after = change
            seen = self._seen_state.get(replica, BreakerState.CLOSED)
            if seen is not before:  # e.g. the cooldown ran out unobserved: open -> half_open, then this
                self._report(replica, seen, before, "cooldown elapsed")
            self._report(replica, before, after, breaker.last_reason)
        self._notice(replica, breaker)

    def state(self, replica: str) -> BreakerState:
        return self._get(replica).state if replica in self._breakers else BreakerState.CLOSED

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget replicas that left; a replacement replica starts closed."""
        keep = set(replicas)
        for replica in [r for r in self._breakers if r not in keep]:
            del self._breakers[replica]
            self._seen_state.pop(replica, None)

    def all_open(self, replicas: Iterable[str]) -> float | None:
        """Seconds until the first probe when every one of `replicas` is blocked; None if any may serve."""
        if not self.config.enabled:
            return None
        waits = []
        for replica in replicas:
            breaker = self._breakers.get(replica)
            if breaker is None or breaker.allows():
                return None
            waits.append(breaker.retry_after_s())
        return min(waits) if waits else None

    def _notice(self, replica: str, breaker: CircuitBreaker) -> None:
        """Report a state change once, however it happened (an outcome, or a cooldown running out)."""
        state = breaker.state
        before = self._seen_state.get(replica, BreakerState.CLOSED)
        if state is not before:
            self._report(replica, before, state, breaker.last_reason)

    def _report(self, replica: str, before: BreakerState, after: BreakerState, why: str) -> None:
        self._seen_state[replica] = after
        if self._on_transition:
            self._on_transition(replica, before, after, why)
