"""Who goes first when a model is full: the requests a gateway admitted beyond what the model's replicas take
at once wait here for a slot, and leave in an order that is fair.

- **Between priority classes, strict priority**: a waiting request of a more urgent class (`flow_control.
  classes`, most urgent first) takes the next free slot before any of a less urgent one.
- **No more than the engines run**: every class together sends the replicas at most the sequences their
  engines run at once (`engine.max_num_seqs` per replica, or what a KV-bound engine reports it runs)
  where that is fewer than the replicas' slots (`max_ongoing_requests`). What an engine queues is first
  come first served within a priority, so requests sent up to the slots (64 against 32 by default) waited
  inside the engine behind each other, and a light tenant the fair queue sent next still waited for 32
  of a flood's requests of its own class to start (TTFT p99 55x idle beside a 260-stream flood). Held
  here instead, the excess waits in the fair queue, where the next turn is the fair one and a client
  that leaves costs nothing. A request counts the sequences it makes (`slots`: `n` choices, a batch's
  inputs); one larger than the whole limit goes alone.
- **Headroom**: a class may fill only its `capacity_share` of those sequences (the most urgent class all of
  them), so work of a less urgent class never holds the sequence an urgent arrival needs: vLLM's
  scheduler does not preempt a running sequence for a more urgent one when its batch is full, only when
  its KV cache is, so headroom counted in slots the engine merely queues would leave an urgent arrival
  waiting for a running request to finish.
- **Headroom between the tenants of a class** (`tenant_headroom`): while another tenant of its class has
  work here or arrived within `hold_s`, a tenant may not fill the last `tenant_headroom` of the class's
  sequences (at least one). The engine does not preempt, and a flood's sequences of one length start
  together and end together: a light tenant the fair queue sent next still waited for the whole wave
  (0.3-3.9 s beside a 260-stream flood of 48-token answers, against 0.1 s alone). With a sequence kept
  free, its request starts at once. A tenant holding nothing always gets one in.
- **Headroom only while it is needed** (issue 52, item 2): held, a class's share left batch work alone on
  half the engine (420-470 against vLLM's 720-755 output tok/s). So a class's share holds only while a
  more urgent class has requests waiting or running here, or had one arrive within `hold_s`; otherwise the
  class may fill every sequence the engines run at once (never more: a request queued inside an engine
  would be ahead of the next urgent arrival there, whatever its scheduling policy). The next urgent arrival
  takes the headroom back at once for every later turn, and itself waits at most for one running sequence
  to end.
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
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shunter.config import PriorityClassConfig


@dataclass(order=True)
class _Waiter:
    start: float
    seq: int
    turn: asyncio.Future[None] = field(compare=False)
    tenant: str = field(compare=False)
    slots: int = field(default=1, compare=False)


_USED_WEIGHT = 0.3  # the moving average's weight of a tenant's latest request
_MOST_TENANTS = 10_000  # tenants' averages kept per class before those fallen behind the clock are dropped
_TENANT_PRESENT_S = 30.0  # with hold_s None: how long a tenant counts as present after its last arrival


class _ClassQueue:
    """One class's waiting requests, in start-tag order, and its tenants' fair-queueing tags."""

    def __init__(self) -> None:
        self.heap: list[_Waiter] = []
        self.waiting = 0  # requests in the heap still waiting (those given up stay there until they surface)
        self.clock = 0.0  # the start tag of the request last given a turn
        self.last_finish: dict[str, float] = {}
        self.used: dict[str, float] = {}  # per tenant: a moving average of the tokens its requests used
        self.credit = 0.0  # anti-starvation turns earned
        self.waiting_by: dict[str, int] = {}  # per tenant: its requests in the heap still waiting

    def push(self, waiter: _Waiter, cost: float, weight: float) -> None:
        heapq.heappush(self.heap, waiter)
        self.waiting += 1
        self.waiting_by[waiter.tenant] = self.waiting_by.get(waiter.tenant, 0) + 1
        self.last_finish[waiter.tenant] = waiter.start + cost / weight

    def start_tag(self, tenant: str) -> float:
        return max(self.clock, self.last_finish.get(tenant, 0.0))

    def head(self) -> _Waiter | None:
        """The next request to go, dropping those given up (a deadline passed, the client left)."""
        while self.heap and self.heap[0].turn.done():
            heapq.heappop(self.heap)
        return self.heap[0] if self.heap else None

    def first_of_others(self, held_back: str, fits: Callable[[_Waiter], bool]) -> _Waiter | None:
        """The first request in tag order that `fits` of a tenant other than `held_back` (whose head may take
        no more now: the headroom between tenants). One pass over the heap, made only while other tenants
        wait: a flood alone behind its own head costs nothing."""
        if self.waiting_by.get(held_back, 0) >= self.waiting:
            return None
        return min((w for w in self.heap if w.tenant != held_back and not w.turn.done() and fits(w)), default=None)

    def pop(self, waiter: _Waiter) -> _Waiter:
        """Take `waiter` (the head, or one `first_of_others` found behind it) out of the queue."""
        if waiter is self.heap[0]:
            heapq.heappop(self.heap)
        else:
            self.heap.remove(waiter)
            heapq.heapify(self.heap)
        self.waiting -= 1
        self._untrack(waiter.tenant)
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

    def give_up(self, turn: asyncio.Future[None], tenant: str) -> None:
        """A waiting request left (its deadline passed, its client left): it no longer counts."""
        turn.cancel()
        self.waiting -= 1
        self._untrack(tenant)

    def _untrack(self, tenant: str) -> None:
        left = self.waiting_by.get(tenant, 0) - 1
        if left > 0:
            self.waiting_by[tenant] = left
        else:
            self.waiting_by.pop(tenant, None)


@dataclass(frozen=True)
class FairCharge:
    """What one request was charged in its class's fair queue: `cost` tokens against `tenant`'s share; and
    the `slots` (engine sequences) its turn holds until it ends (`leave`)."""

    queue: FlowQueue
    rank: int
    tenant: str
    weight: float
    cost: float
    slots: int = 1

    def leave(self) -> None:
        """The request that had this turn ended, however it ended: its sequences are free."""
        self.queue.leave(self.rank, self.slots, self.tenant)

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
                 tick_s: float = 0.25, running: Callable[[], int] | None = None, hold_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, tenant_headroom: float = 0.0):
        """`classes`: most urgent first (their `capacity_share` and `min_share` apply here); by default one.
        `running`: the sequences the engines run at once (this gateway's share), which headroom is counted in
        where fewer than `capacity`. `hold_s`: how long the headroom holds after a more urgent class's last
        arrival (None: always), and how long a tenant counts as present after its last (None: 30 s).
        `tenant_headroom`: the share of a class's sequences one tenant may not fill while another is
        present (0: none)."""
        self.capacity = capacity
        self.running = running
        self.classes = classes or [PriorityClassConfig(name="all")]
        self.tick_s = tick_s
        self.hold_s = hold_s
        self.tenant_headroom = tenant_headroom
        self.clock = clock
        self.dispatched = 0  # engine sequences the requests holding a turn make
        self._dispatched_by_rank = [0] * len(self.classes)
        self._arrived_at = [-math.inf] * len(self.classes)  # each class's latest arrival
        self._queues = [_ClassQueue() for _ in self.classes]
        self._held: list[dict[str, int]] = [{} for _ in self.classes]  # per class: sequences each tenant holds
        self._recent: list[list[tuple[str, float]]] = [[] for _ in self.classes]  # the 2 latest distinct arrivals
        self._seq = itertools.count()
        self._ticking = False

    @property
    def depth(self) -> int:
        """Requests waiting for their turn."""
        return sum(q.waiting for q in self._queues)

    def depth_of(self, rank: int) -> int:
        """Requests of class `rank` waiting for their turn."""
        return self._queues[rank].waiting

    def ahead_of(self, rank: int, tenant: str | None = None) -> int:
        """The slots that must free before a request of class `rank` arriving now gets its turn: those
        waiting of more urgent classes, those of its class (with a `tenant`: only those its tenant's next
        start tag would not go before, its place in the fair queue), plus what its class's headroom keeps
        from it."""
        waiting = sum(q.waiting for q in self._queues[:rank])
        queue = self._queues[rank]
        if tenant is None:
            waiting += queue.waiting
        else:
            tag = queue.start_tag(tenant)
            waiting += sum(1 for w in queue.heap if w.start <= tag and not w.turn.done())
        return waiting + max(0, self.dispatched - self._limit(rank) + 1)

    def waiting_of(self, rank: int, tenant: str) -> int:
        """Requests of `tenant` in class `rank` waiting for their turn."""
        return self._queues[rank].waiting_by.get(tenant, 0)

    async def enter(self, timeout_s: float, rank: int = 0, tenant: str = "", weight: float = 1.0,
                    cost: float = 1.0, slots: int = 1) -> FairCharge | None:
        """Wait for this request's turn: its charge once it may go, None after `timeout_s` (it then holds
        nothing). A request cancelled while it waits holds nothing either. `tenant` and `weight`: whose request
        it is and that tenant's share; `cost`: the most work it may make (tokens), of which its tenant's share
        pays what the tenant's requests really used of late (corrected when it ends: `FairCharge.refund`);
        `slots`: the engine sequences it makes, which its turn holds until `FairCharge.leave`."""
        queue = self._queues[rank]
        self._arrived(rank, tenant)
        self._pump()  # drops turns given up, so a queue of only those is no queue
        slots = max(1, slots)
        charge = FairCharge(self, rank, tenant, weight, queue.expected(tenant, cost), slots)
        if self.depth == 0 and self._fits(rank, slots, tenant):
            queue.clock = max(queue.clock, queue.start_tag(tenant))
            queue.last_finish[tenant] = queue.clock + charge.cost / weight
            self._take_turn(rank, slots, tenant)
            return charge
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.push(_Waiter(queue.start_tag(tenant), next(self._seq), turn, tenant, slots), charge.cost, weight)
        self._pump()  # a less urgent class may still have room for it: then it goes at once
        self._tick()
        try:
            async with asyncio.timeout(timeout_s):
                await turn
            return charge
        except TimeoutError:
            if turn.done() and not turn.cancelled():  # its turn came as the time ran out: it holds it
                return charge
            queue.give_up(turn, tenant)
            charge.give_back()
            self._pump()
            return None
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                charge.leave()
            else:
                queue.give_up(turn, tenant)
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

    def leave(self, rank: int = 0, slots: int = 1, tenant: str = "") -> None:
        """A request of class `rank` and `tenant` that had its turn (of `slots` sequences) ended, however it
        ended."""
        self.dispatched = max(0, self.dispatched - slots)
        self._dispatched_by_rank[rank] = max(0, self._dispatched_by_rank[rank] - slots)
        held = self._held[rank]
        left = held.get(tenant, 0) - slots
        if left > 0:
            held[tenant] = left
        else:
            held.pop(tenant, None)
        self._pump()

    def _take_turn(self, rank: int, slots: int = 1, tenant: str = "") -> None:
        self.dispatched += slots
        self._dispatched_by_rank[rank] += slots
        self._held[rank][tenant] = self._held[rank].get(tenant, 0) + slots

    def _arrived(self, rank: int, tenant: str) -> None:
        now = self.clock()
        self._arrived_at[rank] = now
        recent = self._recent[rank]
        if recent and recent[0][0] == tenant:
            recent[0] = (tenant, now)
        else:
            self._recent[rank] = [(tenant, now), *recent[:1]]

    def _fits(self, rank: int, slots: int, tenant: str = "", limit: int | None = None) -> bool:
        """Whether a request of class `rank` and `tenant` making `slots` sequences may go now: within its
        class's limit, less the headroom kept from its tenant for the other tenants of its class (a tenant
        holding nothing always gets one in), or alone (one larger than the whole limit would otherwise never
        go)."""
        limit = self._limit(rank) if limit is None else limit
        if self.dispatched + slots > limit:
            return self.dispatched == 0 and slots > 1
        held = self._held[rank].get(tenant, 0)
        if held == 0:
            return True
        kept = self._kept_from(rank, tenant, limit)
        return kept == 0 or held + slots <= limit - kept

    def _kept_from(self, rank: int, tenant: str, limit: int) -> int:
        """The sequences of class `rank`'s `limit` that `tenant` may not fill: its tenant headroom while
        another tenant of the class holds or waits for a turn, or arrived within `hold_s`."""
        if self.tenant_headroom <= 0 or limit < 2:
            return 0
        others_hold = self._dispatched_by_rank[rank] > self._held[rank].get(tenant, 0)
        queue = self._queues[rank]
        others_wait = queue.waiting > queue.waiting_by.get(tenant, 0)
        since = self.clock() - (self.hold_s if self.hold_s is not None else _TENANT_PRESENT_S)
        others_came = any(t != tenant and at > since for t, at in self._recent[rank])
        if not (others_hold or others_wait or others_came):
            return 0
        return max(1, math.floor(limit * self.tenant_headroom))

    def _limit(self, rank: int) -> int:
        """The sequences requests of class `rank` may find taken and still go: the replicas' slots or the
        sequences their engines run at once, whichever is fewer; a class without the whole capacity its share
        of those, but all of them while no more urgent work is there or expected (`hold_s`). Always at least
        one, so a model scaled to zero still gets the request whose arrival at Ray's router starts a
        replica."""
        capacity, share = max(0, self.capacity()), self.classes[rank].capacity_share
        if self.running is not None:
            capacity = min(capacity, max(0, self.running()))
        if share < 1 and not self._urgent_expected(rank):
            share = 1.0
        return max(1, math.floor(capacity * share))

    def _urgent_expected(self, rank: int) -> bool:
        """Whether a class more urgent than `rank` has requests waiting or running here, or had one arrive
        within `hold_s` (None: always expected)."""
        if self.hold_s is None:
            return True
        since = self.clock() - self.hold_s
        return any(self._dispatched_by_rank[r] or self._queues[r].waiting or self._arrived_at[r] > since
                   for r in range(rank))

    def _pump(self) -> None:
        while True:
            chosen = self._next_class()
            if chosen is None:
                return
            rank, waiter = chosen
            self._queues[rank].pop(waiter)
            waiter.turn.set_result(None)
            self._take_turn(rank, waiter.slots, waiter.tenant)

    def _next_class(self) -> tuple[int, _Waiter] | None:
        """The class whose next request goes now, and that request, if any may go."""
        candidates: dict[int, _Waiter] = {}
        for r, q in enumerate(self._queues):
            head = q.head()
            if head is None:
                continue
            limit = self._limit(r)
            if self._fits(r, head.slots, head.tenant, limit):
                candidates[r] = head
            elif self.dispatched + head.slots <= limit:  # its tenant's headroom holds it back, not the room
                other = q.first_of_others(head.tenant, lambda w, r=r, limit=limit: self._fits(r, w.slots, w.tenant,
                                                                                               limit))
                if other is not None:
                    candidates[r] = other
        ready = list(candidates)
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
                return rank, candidates[rank]
        return ready[0], candidates[ready[0]]

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
