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

Admitted requests beyond what the replicas take at once wait in the gateway (`shunter.deployments.gateway.
flow_queue`), by priority class and fair share between tenants, and go to Ray's request router only when a
slot frees. Left in Ray's router instead,
that backlog made the router probe the replicas' queue lengths over and over for requests it could not
place (measured: 44% of a saturated gateway's samples), CPU the engines then lacked, and the backlog
started in no particular order.

With priority classes (`flow_control`), the bound is counted per class: the requests of a class and of the
more urgent ones count against it, so a backlog of batch work never turns an interactive request away, and
the wait a request is expected to have is that of its class's place in the flow queue.

Within a class, the bound is shared by its tenants (issue 52, item 1): fair queueing orders who leaves the
queue, but with one count per class a flood of one tenant filled the bound and a light tenant of the same
class was turned away at the door (1 to 8 of 13 requests refused beside a 260-stream flood). So each tenant
of a class has a part of the room its class has (the bound less what the more urgent classes hold), by its
weight among the tenants with admitted work there: a tenant within its part is admitted even when the
class's count is full (its request then waits by its own place in the fair queue, `slots_needed`, which is
near the head for a tenant that sent little), and the tenants past theirs are the ones refused. A full
class takes at most its tenants' parts beyond the bound (at least one request each), and a tenant alone
has the whole room, as before. A refused tenant's Retry-After is its own queue over its own drain rate:
its requests leave at its share's pace, not the class's.

A refused request's Retry-After is kept (`retry_places`): the refusal keeps it a place in its class's line,
due when the slots ahead of it will have freed, and its retry takes it. The slots free for a class at the
rate its own and the less urgent classes' requests finish: a batch request does not get the slots an
interactive one finishing frees while interactive work waits, so counting every class's finishes told a
batch request 13 s where it waited 44 s.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from shunter.deployments.gateway.flow.retry_places import RetryPlaces

DEFAULT_RETRY_AFTER_S = 5
MAX_RETRY_AFTER_S = 60
MIN_FINISHES_FOR_RATE = 8  # finishes in the window before the wait bound trusts the rate


@dataclass(frozen=True)
class Asker:
    """Whose request is at the door: its tenant (the key's name) and the tenant's `share` of its class (the
    key's weight), and how many of the tenant's requests of the class already wait in the flow queue."""

    tenant: str = ""
    share: float = 1.0
    own_waiting: int = 0


@dataclass
class _Tenant:
    share: float
    admitted: int = 0
    finished: deque[float] = field(default_factory=deque)


class AdmissionGate:
    def __init__(self, max_queued: int, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.max_queued = max_queued
        self.window_s = window_s
        self.clock = clock
        self._by_rank: dict[int, int] = {}  # priority class rank -> admitted and not yet finished
        self._finished: dict[int, deque[float]] = {}  # priority class rank -> when its recent requests finished
        self._tenants: dict[int, dict[str, _Tenant]] = {}  # per class rank: tenants admitted or finished of late
        self.places = RetryPlaces(clock, per_owner=max(1, max_queued))

    @property
    def admitted(self) -> int:
        """Admitted requests not yet finished, every class."""
        return sum(self._by_rank.values())

    def admitted_through(self, rank: int) -> int:
        """Admitted requests not yet finished of class `rank` and the more urgent ones."""
        return sum(n for r, n in self._by_rank.items() if r <= rank)

    def admitted_below(self, rank: int) -> int:
        """Admitted requests not yet finished of the classes less urgent than `rank`."""
        return sum(n for r, n in self._by_rank.items() if r > rank)

    def fair_part(self, capacity: int, rank: int, asker: Asker) -> float:
        """The part of its class's room (the bound less what the more urgent classes hold) that `asker`'s
        tenant may fill whatever the others do: its share over the shares of the tenants with admitted work
        in the class, itself included."""
        room = max(0, capacity) + self.max_queued - sum(n for r, n in self._by_rank.items() if r < rank)
        tenants = self._tenants.get(rank, {})
        total = asker.share + sum(t.share for name, t in tenants.items() if name != asker.tenant and t.admitted)
        return max(0.0, room) * asker.share / total

    def within_part(self, capacity: int, rank: int, asker: Asker | None, weight: int = 1) -> bool:
        """Whether `asker`'s tenant, with this request of `weight`, stays within its fair part while other
        tenants of its class hold admitted work (one request at least, where its class has room: a tenant
        with nothing admitted always gets one in). A tenant alone in its class is held to the class's count,
        the places kept for its own refused requests included, as before there were parts."""
        if asker is None:
            return False
        tenants = self._tenants.get(rank, {})
        if not any(t.admitted for name, t in tenants.items() if name != asker.tenant):
            return False
        part = self.fair_part(capacity, rank, asker)
        tenant = tenants.get(asker.tenant)
        admitted = tenant.admitted if tenant is not None else 0
        return part > 0 and (admitted == 0 or admitted + weight <= part)

    def try_admit(self, capacity: int, max_wait_s: float = math.inf, weight: int = 1, rank: int = 0,
                  slots_needed: int | None = None, retry_key: tuple[Hashable, Hashable] | None = None,
                  asker: Asker | None = None) -> int | None:
        """Admit one request (None), or refuse it: the seconds a client should wait before retrying. It is
        refused past the count bound (its class's and the more urgent classes' requests count, and the
        places kept for their refused requests), and when it would wait for a slot longer than `max_wait_s`
        as far as the recent finish rate tells (no rate yet: the count alone decides). `slots_needed`: the
        slots that must free before it starts (the flow queue's count for its class); by default, what the
        admitted requests beyond capacity say. A request that can start at once is never refused for places.

        `retry_key`: who is asking for what (the caller, and the body's digest). A refusal keeps that key a
        place due at the Retry-After it is told; the same key coming back then is admitted on it.

        `weight`: the engine requests it makes (a batch of embedding inputs or completion prompts, times
        `n`): it counts as that many (`admitted_weight` says how many it took; release that many). A batch
        larger than the whole bound counts as the whole bound, so an idle model still takes it, alone.

        `asker`: whose request it is (see the module docstring: a tenant within its fair part of its class
        is admitted past the class's count, `slots_needed` being its own place in the fair queue; refused,
        a tenant is told its own queue over its own drain rate)."""
        weight = self.admitted_weight(capacity, weight)
        needed = self._needed(capacity, rank, slots_needed)
        # A place not yet due is no one's yet: the same body may well be another request (a tenant sending
        # one prompt many times), so only a due place is taken, and an early request is a new one.
        place = self.places.find(retry_key, rank) if retry_key is not None else None
        due = place is not None and self.places.is_due(place)
        within = self.within_part(capacity, rank, asker, weight)
        if not due and self._over(capacity, max_wait_s, weight, rank, slots_needed, needed, within):
            return self.retry_after_s(needed, rank, retry_key, weight, None if within else asker)
        if due:
            self.places.take(place)
        self._by_rank[rank] = self._by_rank.get(rank, 0) + weight
        if asker is not None:
            tenant = self._tenants.setdefault(rank, {}).setdefault(asker.tenant, _Tenant(asker.share))
            tenant.admitted += weight
            tenant.share = asker.share
        return None

    def refuses(self, capacity: int, max_wait_s: float = math.inf, weight: int = 1, rank: int = 0,
                slots_needed: int | None = None, retry_key: tuple[Hashable, Hashable] | None = None,
                asker: Asker | None = None) -> bool:
        """Whether `try_admit` with the same arguments would refuse; changes nothing (the door asks before
        it parses a body: a full model's refusal costs no parsing)."""
        place = self.places.find(retry_key, rank) if retry_key is not None else None
        if place is not None and self.places.is_due(place):
            return False
        weight = self.admitted_weight(capacity, weight)
        return self._over(capacity, max_wait_s, weight, rank, slots_needed,
                          self._needed(capacity, rank, slots_needed), self.within_part(capacity, rank, asker, weight))

    def _over(self, capacity: int, max_wait_s: float, weight: int, rank: int, slots_needed: int | None,
              needed: int, within_part: bool = False) -> bool:
        """Past the count bound (places kept for refused requests count while it would have to wait), or
        expected to wait longer than `max_wait_s`. A tenant within its fair part is held to the wait only:
        its own place in the fair queue (`slots_needed`), where the places kept for others' retries are
        not ahead of it (a retry takes its tenant's place in the fair queue, behind a lighter tenant's)."""
        bound = max(0, capacity) + self.max_queued
        if within_part:
            wait = self.expected_wait_s(capacity, rank, slots_needed, count_places=False)
            return wait is not None and wait > max_wait_s
        if needed <= 0:
            return self.admitted_through(rank) + weight > bound
        kept = self.places.kept_through(rank)
        wait = self.expected_wait_s(capacity, rank, slots_needed)
        return self.admitted_through(rank) + kept + weight > bound or (wait is not None and wait > max_wait_s)

    def admitted_weight(self, capacity: int, weight: int) -> int:
        """What a request of `weight` engine requests counts for at this gate (at least 1, at most the bound)."""
        return max(1, min(weight, max(0, capacity) + self.max_queued))

    def expected_wait_s(self, capacity: int, rank: int = 0, slots_needed: int | None = None,
                        count_places: bool = True) -> float | None:
        """How long a request admitted now would wait for a slot: 0 while there is room, else the slots that
        must free first (places kept for refused requests of its class and the more urgent ones included)
        over the rate they free for its class; None while too few of its class and the less urgent ones
        finished to tell (the other classes' rate says nothing of how fast a burst of this one clears: a
        flood of batch work after a quiet spell of short interactive requests would be refused on it)."""
        needed = self._needed(capacity, rank, slots_needed)
        if needed <= 0:
            return 0.0
        rate = self._rate(rank, fallback=False)
        kept = self.places.kept_through(rank) if count_places else 0
        return None if rate is None else (needed + kept) / rate

    def release(self, weight: int = 1, rank: int = 0, tenant: str | None = None) -> None:
        """An admitted request finished, however it ended (`weight`: what it was admitted as; `tenant`:
        whose, where it was admitted with an `Asker`)."""
        left = self._by_rank.get(rank, 0) - weight
        if left > 0:
            self._by_rank[rank] = left
        else:
            self._by_rank.pop(rank, None)
        now = self.clock()
        self._finished.setdefault(rank, deque()).extend([now] * weight)
        known = self._tenants.get(rank, {}).get(tenant) if tenant is not None else None
        if known is not None:
            known.admitted = max(0, known.admitted - weight)
            known.finished.extend([now] * weight)
        self._expire()

    def queued(self, capacity: int, rank: int | None = None) -> int:
        """Admitted requests beyond what the running replicas take at once (of class `rank` and the more
        urgent ones; None: every class)."""
        admitted = self.admitted if rank is None else self.admitted_through(rank)
        return max(0, admitted - max(0, capacity))

    def finish_rate(self) -> float:
        """Admitted requests finished per second over the recent window."""
        self._expire()
        return sum(len(f) for f in self._finished.values()) / self.window_s

    def retry_after_s(self, slots_needed: int, rank: int = 0, retry_key: tuple[Hashable, Hashable] | None = None,
                      weight: int = 1, asker: Asker | None = None) -> int:
        """When a refused request should come back: the time the slots ahead of it (places kept for earlier
        refusals included) take to free at the rate they free for its class (a default until enough requests
        finished to tell), at least a second. With an `asker` (a tenant refused past its fair part) whose
        tenant has a drain rate of its own, its own waiting requests over that rate: the fair queue lets them
        go at its share's pace. With a `retry_key`, a place is kept for it, due then."""
        own = self._tenant_rate(rank, asker)
        if own is not None and asker is not None:
            ahead, rate = float(asker.own_waiting + weight), own
        else:
            rate = self._rate(rank)
            if rate is None:
                rate = self.finish_rate()
            if rate <= 0:
                return DEFAULT_RETRY_AFTER_S
            ahead = max(1, slots_needed) + self.places.kept_through(rank)
        wait = math.ceil(ahead / rate)
        if wait > MAX_RETRY_AFTER_S:
            return MAX_RETRY_AFTER_S  # no place: "not before", nothing promised
        wait = max(1, wait)
        if retry_key is not None:
            self.places.keep(retry_key, rank, weight, wait)
        return wait

    def _needed(self, capacity: int, rank: int, slots_needed: int | None) -> int:
        return self.queued(capacity, rank) + 1 if slots_needed is None else slots_needed

    def _rate(self, rank: int = 0, fallback: bool = True) -> float | None:
        """Slots freed per second for class `rank`: its own and the less urgent classes' finishes (the more
        urgent ones' slots go to their own waiting work first); with `fallback`, every class's while those
        are too few to trust; None while even those are."""
        self._expire()
        for ranks in ([r for r in self._finished if r >= rank], list(self._finished))[:2 if fallback else 1]:
            finished = [self._finished[r] for r in ranks if self._finished[r]]
            count = sum(len(f) for f in finished)
            if count >= MIN_FINISHES_FOR_RATE:
                span = max(1.0, self.clock() - min(f[0] for f in finished))
                return count / span
        return None

    def _tenant_rate(self, rank: int, asker: Asker | None) -> float | None:
        """Requests of `asker`'s tenant in class `rank` finished per second of late; None while too few."""
        tenant = self._tenants.get(rank, {}).get(asker.tenant) if asker is not None else None
        if tenant is None:
            return None
        self._expire()
        if len(tenant.finished) < MIN_FINISHES_FOR_RATE:
            return None
        return len(tenant.finished) / max(1.0, self.clock() - tenant.finished[0])

    def _expire(self) -> None:
        horizon = self.clock() - self.window_s
        for finished in self._finished.values():
            while finished and finished[0] < horizon:
                finished.popleft()
        for tenants in self._tenants.values():
            for name in [n for n, t in tenants.items() if self._expired(t, horizon)]:
                del tenants[name]

    @staticmethod
    def _expired(tenant: _Tenant, horizon: float) -> bool:
        """Drops a tenant's finishes past the window; true once it has nothing admitted and none left."""
        while tenant.finished and tenant.finished[0] < horizon:
            tenant.finished.popleft()
        return not tenant.admitted and not tenant.finished
