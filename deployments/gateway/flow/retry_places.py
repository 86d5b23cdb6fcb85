"""Places kept for refused requests: a 429's Retry-After is a promise, and the gate keeps it.

Under sustained overload a refused request that comes back when told otherwise meets the same full queue:
the requests that arrived meanwhile took the slots that freed, so it is refused again (measured: 89% of
retries, told 13 s, waited 44 s when they got in at all). A Retry-After is only honest if coming back then
works. So a refusal keeps the request a place in its class's line, due when the slots ahead of it (the
queue, and the places kept before it) will have freed; requests arriving later count the kept places as
ahead of them, and the refused request's retry (the same caller sending the same body, as every OpenAI
client's retry does) takes its place when due, whatever the queue's length then.

A place not taken within its grace (half the wait told, at least `MIN_GRACE_S`) lapses, so a client that
never comes back holds nothing for long; a model with a free slot never leaves it idle for a place (the
gate admits whoever can start at once). Places are kept per gateway process: a retry that lands on
another gateway is a new request there. Their number is bounded (`MAX_PLACES`), and so is each caller's
(`per_owner`, the gate's queue bound: what it could hold by being admitted), so a caller sending many
different requests it never retries cannot keep the line from everyone else; past either bound a refusal
keeps no place.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

MAX_PLACES = 4096  # per model and gateway: far above what a minute of refusals at these rates keeps
MIN_GRACE_S = 2.0  # how long at least a due place waits for its retry
EARLY_S = 1.0  # a retry this early still takes its place (Retry-After is whole seconds, rounded up)


@dataclass(slots=True)
class Place:
    key: tuple[Hashable, Hashable]  # (owner: who asks, what it asks: the body's digest)
    rank: int
    weight: int
    due: float
    lapses: float
    live: bool = True


class RetryPlaces:
    """One model's kept places in one gateway (see the module docstring), found by (owner, body digest)."""

    def __init__(self, clock: Callable[[], float], max_places: int = MAX_PLACES, per_owner: int = MAX_PLACES):
        self.clock = clock
        self.max_places, self.per_owner = max_places, per_owner
        self._by_key: dict[tuple[Hashable, Hashable], deque[Place]] = {}
        self._by_owner: dict[Hashable, int] = {}
        self._weight_by_rank: dict[int, int] = {}
        self._lapsing: list[tuple[float, int, Place]] = []  # heap by when each place lapses
        self._seq = itertools.count()
        self._live = 0

    def __len__(self) -> int:
        self._lapse()
        return self._live

    def kept_through(self, rank: int) -> int:
        """The weight of the places kept for class `rank` and the more urgent ones."""
        self._lapse()
        return sum(w for r, w in self._weight_by_rank.items() if r <= rank)

    def keep(self, key: tuple[Hashable, Hashable], rank: int, weight: int, wait_s: float) -> bool:
        """Keep a place for `key`'s retry, due in `wait_s`; False when a bound allows no more."""
        self._lapse()
        if self._live >= self.max_places or self._by_owner.get(key[0], 0) >= self.per_owner:
            return False
        self._by_owner[key[0]] = self._by_owner.get(key[0], 0) + 1
        now = self.clock()
        place = Place(key, rank, weight, now + wait_s, now + wait_s + max(MIN_GRACE_S, wait_s / 2))
        self._by_key.setdefault(key, deque()).append(place)
        self._weight_by_rank[rank] = self._weight_by_rank.get(rank, 0) + weight
        heapq.heappush(self._lapsing, (place.lapses, next(self._seq), place))
        self._live += 1
        return True

    def find(self, key: tuple[Hashable, Hashable], rank: int) -> Place | None:
        """`key`'s earliest place in class `rank`, if one is kept."""
        self._lapse()
        return next((p for p in self._by_key.get(key, ()) if p.rank == rank), None)

    def take(self, place: Place) -> None:
        """The retry came: its place is used (it is admitted as the place's weight was counted)."""
        if place.live:
            self._drop(place)

    def is_due(self, place: Place) -> bool:
        return self.clock() >= place.due - EARLY_S

    def _drop(self, place: Place) -> None:
        place.live = False
        self._live -= 1
        owned = self._by_owner.get(place.key[0], 0) - 1
        if owned > 0:
            self._by_owner[place.key[0]] = owned
        else:
            self._by_owner.pop(place.key[0], None)
        waiting = self._by_key.get(place.key)
        if waiting is not None:
            waiting.remove(place)
            if not waiting:
                del self._by_key[place.key]
        left = self._weight_by_rank.get(place.rank, 0) - place.weight
        if left > 0:
            self._weight_by_rank[place.rank] = left
        else:
            self._weight_by_rank.pop(place.rank, None)

    def _lapse(self) -> None:
        now = self.clock()
        while self._lapsing and (self._lapsing[0][0] < now or not self._lapsing[0][2].live):
            _, _, place = heapq.heappop(self._lapsing)
            if place.live:
                self._drop(place)
