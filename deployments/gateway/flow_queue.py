"""Who goes first when a model is full: the requests a gateway admitted beyond what the model's replicas take
at once wait here for a slot, and leave in an order that is fair.

- **Between priority classes, strict priority**: a waiting request of a more urgent class (`flow_control.
  classes`, most urgent first) takes the next free slot before any of a less urgent one.
- **Headroom**: a class may fill only its `capacity_share` of the model's slots (the most urgent class all of
  them), so work of a less urgent class never holds the slot an urgent arrival needs; the engine's own
  priority scheduling (`engine.scheduling_policy: priority`) then runs that arrival ahead of the work
  already there. The share is taken of the sequences the engines run at once (`engine.max_num_seqs` per
  replica) where that is fewer than the replicas' slots (`max_ongoing_requests`): vLLM's scheduler does not
  preempt a running sequence for a more urgent one when its batch is full, only when its KV cache is, so
  headroom counted in slots the engine merely queues would leave an urgent arrival waiting for a running
  request to finish.
- **Anti-starvation**: each time a slot frees while a less urgent class has requests waiting that its
  headroom would let go, that class earns `min_share` of a turn, and a class with a whole turn earned takes
  the slot. So while urgent work keeps a model full, a less urgent class still gets `min_share` of the slots
  that free (1 in 20 for 0.05), never nothing; with `min_share` 0 it waits until no more urgent request does.
- **Within a class, weighted fair queueing between tenants** (start-time fair queueing): each request is
  tagged with its tenant's virtual start time, `max(class clock, the tenant's last finish)`, and its
  finish, start + cost / weight, where the cost is the tokens it may use and the weight its key's
  `weight`. The smallest start goes first, and the class clock moves to it. A tenant sending ten times more
  gets its weight's share of the slots while others wait, and every slot nobody else wants (the queue is
  work-conserving); a tenant that was idle starts at the clock, with no credit saved up.

Each gateway replica queues its own share of a model's slots (`capacity` is this gateway's share, as for
admission), so with several gateways, each shares its part fairly and the whole stays fair.

Shares by what was used (issue 52, item 4): charged what it *may* use (its prompt estimate and `max_tokens`,
or the model's default: thousands of tokens for a client that sends no `max_tokens`), a tenant that leaves
`max_tokens` out got about a hundredth of the turns of one asking for 16. So a request is charged what its
tenant's requests in this class really used of late (a moving average, never more than it may use; what it
may use until the tenant has a history), and the charge is corrected when it ends (`FairCharge.refund`): the
difference is given back, or charged, to the tenant, and its requests still waiting move by it; a request
that leaves unserved gives all of its charge back.

A request that waits past its deadline, or whose client leaves, gives up its place (nothing is held). A
request that got its turn holds it until it ends (`leave`). Capacity that grows without a request ending (a
replica started) is noticed every `tick_s` while requests wait.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from shunter.config import PriorityClassConfig


@dataclass(order=True)
class _Waiter:
    start: float
    seq: int
    turn: asyncio.Future[None] = field(compare=False)
    tenant: str = field(compare=False)


_USED_WEIGHT = 0.3  # the moving average's weight of a tenant's latest request
_MOST_TENANTS = 10_000  # tenants' averages kept per class before those fallen behind the clock are dropped


class _ClassQueue:
    """One class's waiting requests, in start-tag order, and its tenants' fair-queueing tags."""

    def __init__(self) -> None:
        self.heap: list[_Waiter] = []
        self.waiting = 0  # requests in the heap still waiting (those given up stay there until they surface)
        self.clock = 0.0  # the start tag of the request last given a turn
        self.last_finish: dict[str, float] = {}
        self.used: dict[str, float] = {}  # per tenant: a moving average of the tokens its requests used
        self.credit = 0.0  # anti-starvation turns earned

    def push(self, waiter: _Waiter, cost: float, weight: float) -> None:
        heapq.heappush(self.heap, waiter)
        self.waiting += 1
        self.last_finish[waiter.tenant] = waiter.start + cost / weight

    def start_tag(self, tenant: str) -> float:
        return max(self.clock, self.last_finish.get(tenant, 0.0))

    def head(self) -> _Waiter | None:
        """The next request to go, dropping those given up (a deadline passed, the client left)."""
        while self.heap and self.heap[0].turn.done():
            heapq.heappop(self.heap)
        return self.heap[0] if self.heap else None

    def pop(self) -> _Waiter:
        waiter = heapq.heappop(self.heap)
        self.waiting -= 1
        self.clock = max(self.clock, waiter.start)
        if len(self.last_finish) > 4 * len(self.heap) + 64:  # tenants whose tags fell behind the clock
            self.last_finish = {t: f for t, f in self.last_finish.items() if f > self.clock}
        return waiter

    def expected(self, tenant: str, at_most: float) -> float:
        """What a request of `tenant` that may use `at_most` tokens is charged: its recent average, capped."""
        used = self.used.get(tenant)
        return at_most if used is None else max(1.0, min(at_most, used))

    def shift(self, tenant: str, by: float) -> None:
        """Tenant's virtual time moves by `by` (a charge corrected): its next request's tag and those of
        its requests still waiting, never before the clock (no credit is saved up)."""
        if tenant in self.last_finish:
            self.last_finish[tenant] -= by
        moved = False
        for waiter in self.heap:
            if waiter.tenant == tenant and not waiter.turn.done():
                waiter.start = max(self.clock, waiter.start - by)
                moved = True
        if moved:
            heapq.heapify(self.heap)

    def give_up(self, turn: asyncio.Future[None]) -> None:
        """A waiting request left (its deadline passed, its client left): it no longer counts."""
        turn.cancel()
        self.waiting -= 1


@dataclass(frozen=True)
class FairCharge:
    """What one request was charged in its class's fair queue: `cost` tokens against `tenant`'s share."""

    queue: FlowQueue
    rank: int
    tenant: str
    weight: float
    cost: float

    def refund(self, used: float) -> None:
        """The request ended having used `used` tokens: its charge is corrected to them (what was charged
        beyond them goes back to its tenant; what it used beyond them is charged)."""
        used = max(0.0, used)
        self.queue.correct(self.rank, self.tenant, (self.cost - used) / self.weight, used)

    def give_back(self) -> None:
        """The request left unserved: all of its charge goes back."""
        self.queue.correct(self.rank, self.tenant, self.cost / self.weight)


class FlowQueue:
    """One model's waiting requests in one gateway; see the module docstring."""

    def __init__(self, capacity: Callable[[], int], classes: list[PriorityClassConfig] | None = None,
                 tick_s: float = 0.25, running: Callable[[], int] | None = None):
        """`classes`: most urgent first (their `capacity_share` and `min_share` apply here); by default one.
        `running`: the sequences the engines run at once (this gateway's share), which headroom is counted in
        where fewer than `capacity`."""
        self.capacity = capacity
        self.running = running
        self.classes = classes or [PriorityClassConfig(name="all")]
        self.tick_s = tick_s
        self.dispatched = 0  # requests holding a turn
        self._queues = [_ClassQueue() for _ in self.classes]
        self._seq = itertools.count()
        self._ticking = False

    @property
    def depth(self) -> int:
        """Requests waiting for their turn."""
        return sum(q.waiting for q in self._queues)

    def depth_of(self, rank: int) -> int:
        """Requests of class `rank` waiting for their turn."""
        return self._queues[rank].waiting

    def ahead_of(self, rank: int) -> int:
        """The slots that must free before a request of class `rank` arriving now gets its turn: those
        waiting of its class and more urgent ones, plus what its class's headroom keeps from it."""
        waiting = sum(q.waiting for q in self._queues[:rank + 1])
        return waiting + max(0, self.dispatched - self._limit(rank) + 1)

    async def enter(self, timeout_s: float, rank: int = 0, tenant: str = "", weight: float = 1.0,
                    cost: float = 1.0) -> FairCharge | None:
        """Wait for this request's turn: its charge once it may go, None after `timeout_s` (it then holds
        nothing). A request cancelled while it waits holds nothing either. `tenant` and `weight`: whose request
        it is and that tenant's share; `cost`: the most work it may make (tokens), of which its tenant's share
        pays what the tenant's requests really used of late (corrected when it ends: `FairCharge.refund`)."""
        queue = self._queues[rank]
        self._pump()  # drops turns given up, so a queue of only those is no queue
        charge = FairCharge(self, rank, tenant, weight, queue.expected(tenant, cost))
        if self.depth == 0 and self.dispatched < self._limit(rank):
            queue.clock = max(queue.clock, queue.start_tag(tenant))
            queue.last_finish[tenant] = queue.clock + charge.cost / weight
            self.dispatched += 1
            return charge
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.push(_Waiter(queue.start_tag(tenant), next(self._seq), turn, tenant), charge.cost, weight)
        self._pump()  # a less urgent class may still have room for it: then it goes at once
        self._tick()
        try:
            async with asyncio.timeout(timeout_s):
                await turn
            return charge
        except TimeoutError:
            if turn.done() and not turn.cancelled():  # its turn came as the time ran out: it holds it
                return charge
            queue.give_up(turn)
            charge.give_back()
            self._pump()
            return None
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.leave()
            else:
                queue.give_up(turn)
                self._pump()
            charge.give_back()  # unserved: it used nothing
            raise

    def correct(self, rank: int, tenant: str, by: float, used: float | None = None) -> None:
        """Tenant's share in class `rank` moves back by `by` (of virtual time: tokens / weight); `used`: the
        tokens a request of it used, for its moving average."""
        queue = self._queues[rank]
        if used is not None:
            last = queue.used.get(tenant)
            queue.used[tenant] = used if last is None else last + _USED_WEIGHT * (used - last)
            if len(queue.used) > _MOST_TENANTS:  # keep the tenants with tags still ahead of the clock
                queue.used = {t: u for t, u in queue.used.items() if t in queue.last_finish}
        if by:
            queue.shift(tenant, by)

    def leave(self) -> None:
        """A request that had its turn ended, however it ended."""
        self.dispatched = max(0, self.dispatched - 1)
        self._pump()

    def _limit(self, rank: int) -> int:
        """The turns requests of class `rank` may find taken and still go: every slot for a class with the
        whole capacity, else its share of the slots or of the engines' running sequences, whichever is fewer
        (always at least one, so a model scaled to zero still gets the request whose arrival at Ray's router
        starts a replica)."""
        capacity, share = max(0, self.capacity()), self.classes[rank].capacity_share
        if share < 1 and self.running is not None:
            capacity = min(capacity, max(0, self.running()))
        return max(1, math.floor(capacity * share))

    def _pump(self) -> None:
        while True:
            rank = self._next_class()
            if rank is None:
                return
            waiter = self._queues[rank].pop()
            waiter.turn.set_result(None)
            self.dispatched += 1

    def _next_class(self) -> int | None:
        """The class whose head goes next, if any may go now."""
        ready = [r for r, q in enumerate(self._queues) if q.head() is not None and self.dispatched < self._limit(r)]
        if not ready:
            return None
        # Each less urgent class that could go earns its share of this turn; one with a whole turn earned
        # takes it (so it gets `min_share` of the turns while it waits), else the most urgent class does.
        for rank in ready[1:]:
            queue = self._queues[rank]
            queue.credit = min(1.0, queue.credit + self.classes[rank].min_share)
        for rank in ready[1:]:
            if self._queues[rank].credit >= 1.0:
                self._queues[rank].credit -= 1.0
                return rank
        return ready[0]

    def _tick(self) -> None:
        if self._ticking:
            return
        self._ticking = True

        def tick() -> None:
            self._ticking = False
            self._pump()
            if self.depth:
                self._tick()

        asyncio.get_running_loop().call_later(self.tick_s, tick)
