"""The flow queue: when an admitted request goes to the replicas. Strict priority between classes (with
headroom and anti-starvation), weighted fair shares between tenants inside a class, deadlines and hang-ups
that give the place up (shunter.deployments.gateway.flow.queue)."""

from __future__ import annotations

import asyncio
import contextlib

from shunter.config import PriorityClassConfig
from shunter.deployments.gateway.flow.queue import FlowQueue


def shares(**values: float) -> PriorityClassConfig:
    """A priority class as the queue sees it: only its shares matter here."""
    return PriorityClassConfig(name="c", **values)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def until(condition) -> None:
    """Let the other tasks run until `condition()` holds: their progress, not a span of time, is what the
    next step needs (`_run` bounds the whole test)."""
    while not condition():
        await asyncio.sleep(0.001)


def test_admitted_requests_beyond_capacity_wait_in_arrival_order_and_go_as_slots_free():
    async def run() -> list[int]:
        queue = FlowQueue(lambda: 2)
        started: list[int] = []

        async def request(i: int) -> None:
            assert await queue.enter(timeout_s=5)
            started.append(i)

        tasks = [asyncio.create_task(request(i)) for i in range(6)]
        await until(lambda: len(started) == 2 and queue.depth == 4)
        assert started == [0, 1] and queue.depth == 4 and queue.dispatched == 2
        for n in range(3, 7):
            queue.leave()
            await until(lambda n=n: len(started) == n)  # the next waiter is on its way before the next slot
        await asyncio.gather(*tasks)
        assert queue.dispatched == 2 and queue.depth == 0
        return started

    assert _run(run()) == [0, 1, 2, 3, 4, 5], "first come, first served"


def test_a_model_with_no_capacity_still_sends_one_request_so_ray_starts_a_replica():
    async def run() -> None:
        capacity = [0]
        queue = FlowQueue(lambda: capacity[0], tick_s=0.02)
        assert await queue.enter(timeout_s=1), "the one that starts a replica"
        waiting = asyncio.create_task(queue.enter(timeout_s=5))
        await until(lambda: waiting.done() or queue.depth == 1)
        assert not waiting.done() and queue.depth == 1
        capacity[0] = 4  # a replica started: noticed without any request ending
        assert await waiting

    _run(run())


def test_a_request_that_waits_too_long_or_whose_client_leaves_holds_nothing():
    async def run() -> None:
        queue = FlowQueue(lambda: 1)
        assert await queue.enter(timeout_s=1)
        assert not await queue.enter(timeout_s=0.05), "timed out"
        gone = asyncio.create_task(queue.enter(timeout_s=5))
        later = asyncio.create_task(queue.enter(timeout_s=5))
        await until(lambda: queue.depth == 2)
        assert queue.waiting_of(0, "") == 2
        gone.cancel()
        await until(gone.done)
        assert queue.waiting_of(0, "") == 1, "a request given up no longer counts as its tenant's"
        queue.leave()
        assert await later, "the next live waiter gets the slot the cancelled one gave up"
        assert queue.dispatched == 1 and queue.depth == 0 and queue.waiting_of(0, "") == 0

    _run(run())


def test_a_request_cancelled_as_its_turn_came_gives_the_turn_back():
    async def run() -> None:
        queue = FlowQueue(lambda: 1)
        assert await queue.enter(timeout_s=1)
        waiter = asyncio.create_task(queue.enter(timeout_s=5))
        await until(lambda: queue.depth == 1)
        queue.leave()  # its turn comes ...
        waiter.cancel()  # ... and its client leaves before it runs
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        assert queue.dispatched == 0, "the turn is not leaked"

    _run(run())


def test_turns_given_up_do_not_hold_back_the_next_request():
    async def run() -> None:
        capacity = [1]
        queue = FlowQueue(lambda: capacity[0], tick_s=60)  # no tick to rescue a stuck request
        assert await queue.enter(timeout_s=1)
        gone = asyncio.create_task(queue.enter(timeout_s=5))
        await until(lambda: queue.depth == 1)
        gone.cancel()
        await until(gone.done)
        capacity[0] = 2  # a replica started; nothing ended
        # Nothing else can let it in (no tick, nothing ends): held back, it would time out and say False.
        assert await queue.enter(timeout_s=5), "room and no live waiter: no wait"

    _run(run())




async def _hold(queue: FlowQueue, n: int) -> None:
    """`n` requests take their turns at once (the queue is empty and has room)."""
    for _ in range(n):
        assert await queue.enter(timeout_s=1)


async def _queue_up(queue: FlowQueue, requests: list[tuple[str, dict]], order: list[str]) -> list[asyncio.Task[bool]]:
    """Queue `requests` (name, enter's arguments) in this order; `order` gets each one's name as its turn comes."""
    tasks = []
    for name, kwargs in requests:
        task = asyncio.create_task(queue.enter(timeout_s=5, **kwargs))
        task.add_done_callback(lambda t, name=name: order.append(name) if not t.cancelled() and t.result() else None)
        tasks.append(task)
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    return tasks


async def _drain(queue: FlowQueue, waiting: list[asyncio.Task[bool]]) -> None:
    """Free one slot at a time until nobody waits."""
    while not all(task.done() for task in waiting):
        queue.leave()
        await asyncio.sleep(0)
        await asyncio.sleep(0)


def test_with_a_held_queue_a_more_urgent_class_starts_before_earlier_less_urgent_requests():
    async def run() -> list[str]:
        queue = FlowQueue(lambda: 1, [shares(), shares(), shares()])
        await _hold(queue, 1)
        order: list[str] = []
        waiting = await _queue_up(queue, [("batch", {"rank": 2}), ("standard", {"rank": 1}), ("batch", {"rank": 2}),
                                          ("interactive", {"rank": 0}), ("standard", {"rank": 1})], order)
        assert queue.depth == 5 and [queue.depth_of(r) for r in range(3)] == [1, 2, 2]
        await _drain(queue, waiting)
        return order

    assert _run(run()) == ["interactive", "standard", "standard", "batch", "batch"]


def test_a_class_fills_only_its_share_of_the_slots_so_an_urgent_arrival_finds_one_free():
    async def run() -> None:
        queue = FlowQueue(lambda: 4, [shares(), shares(capacity_share=0.5)])
        assert await queue.enter(timeout_s=1, rank=1) and await queue.enter(timeout_s=1, rank=1)
        assert not await queue.enter(timeout_s=0.05, rank=1), "batch's half of the slots is taken"
        assert queue.ahead_of(1) == 1 and queue.ahead_of(0) == 0
        assert await asyncio.wait_for(queue.enter(timeout_s=5, rank=0), 0.5), "interactive goes at once"
        assert queue.dispatched == 3

    _run(run())


def test_a_less_urgent_class_still_gets_its_min_share_of_the_turns_while_urgent_work_keeps_the_model_full():
    async def run() -> list[str]:
        queue = FlowQueue(lambda: 1, [shares(), shares(min_share=0.25)])
        await _hold(queue, 1)
        order: list[str] = []
        waiting = await _queue_up(queue, [("batch", {"rank": 1})] * 3 + [("interactive", {"rank": 0})] * 9, order)
        await _drain(queue, waiting)
        return order

    order = _run(run())
    assert order[:8].count("batch") == 2 and order[3] == order[7] == "batch", order
    starved = FlowQueue(lambda: 1, [shares(), shares()])

    async def strict() -> list[str]:
        await _hold(starved, 1)
        order: list[str] = []
        waiting = await _queue_up(starved, [("batch", {"rank": 1})] + [("interactive", {"rank": 0})] * 4, order)
        await _drain(starved, waiting)
        return order

    assert _run(strict()) == ["interactive"] * 4 + ["batch"], "min_share 0: strict priority"


def test_tenants_of_one_class_get_turns_in_proportion_to_their_weights_however_much_each_sends():
    async def run(weights: dict[str, float], sent: dict[str, int], first: int) -> list[str]:
        queue = FlowQueue(lambda: 1)
        await _hold(queue, 1)
        requests = [(t, {"tenant": t, "weight": weights[t]}) for t in sent for _ in range(sent[t])]
        order: list[str] = []
        waiting = await _queue_up(queue, requests, order)
        await _drain(queue, waiting)
        return order[:first]

    equal = _run(run({"flood": 1, "light": 1}, {"flood": 30, "light": 5}, 10))
    assert equal.count("light") == 5, "sending 6x more buys the flood no more than its half while light waits"
    weighted = _run(run({"big": 3, "small": 1}, {"big": 30, "small": 30}, 20))
    assert weighted.count("big") == 15 and weighted.count("small") == 5, weighted
    alone = _run(run({"flood": 1, "light": 1}, {"flood": 10, "light": 0}, 10))
    assert alone == ["flood"] * 10, "all of the capacity nobody else wants"


def test_shares_count_the_tokens_a_request_may_use():
    async def run() -> list[str]:
        queue = FlowQueue(lambda: 1)
        await _hold(queue, 1)
        order: list[str] = []
        waiting = await _queue_up(queue, [("long", {"tenant": "long", "cost": 400})] * 10
                                  + [("short", {"tenant": "short", "cost": 100})] * 10, order)
        await _drain(queue, waiting)
        return order[:10]

    assert _run(run()).count("short") == 8, "a tenant whose requests are 4x longer gets a quarter of the turns"


def test_a_tenant_that_was_idle_starts_at_the_class_clock_with_no_credit_saved_up():
    async def run() -> list[str]:
        queue = FlowQueue(lambda: 1)
        await _hold(queue, 1)
        order: list[str] = []
        busy = await _queue_up(queue, [("busy", {"tenant": "busy"})] * 20, order)
        for _ in range(10):  # busy alone takes 10 turns
            queue.leave()
            await asyncio.sleep(0)
        late = await _queue_up(queue, [("late", {"tenant": "late"})] * 10, order)
        await _drain(queue, busy + late)
        assert order[:10] == ["busy"] * 10
        return order[10:20]

    first_ten_after = _run(run())
    assert 4 <= first_ten_after.count("late") <= 6, first_ten_after


def test_headroom_is_counted_in_the_sequences_the_engine_runs_when_fewer_than_the_slots():
    """64 slots but engines that run 32 sequences at once: batch (0.75) may hold 24 turns, not 48, so an
    urgent arrival finds a running sequence free in the engine, not only a place in its queue."""
    classes = [PriorityClassConfig(name="interactive"), PriorityClassConfig(name="batch", capacity_share=0.75)]

    async def run() -> tuple[int, bool]:
        queue = FlowQueue(lambda: 64, classes, running=lambda: 32)
        waiting = [asyncio.ensure_future(queue.enter(60, rank=1)) for _ in range(30)]
        await asyncio.sleep(0)
        admitted = queue.dispatched
        urgent = await asyncio.wait_for(queue.enter(60, rank=0), 1)
        for w in waiting:
            w.cancel()
        return admitted, urgent

    admitted, urgent = asyncio.run(run())
    assert admitted == 24 and urgent
    unlimited = FlowQueue(lambda: 64, classes, running=lambda: 128)
    assert unlimited._limit(1) == 48 and unlimited._limit(0) == 64, "more sequences than slots: the slots count"


def test_no_class_sends_more_than_the_engines_run_so_a_light_tenant_goes_at_the_next_free_sequence():
    """Issue 52: 64 slots, engines that run 32 sequences. A flood of the most urgent class (the whole
    capacity) takes the 32 and waits here for the rest, not inside the engine, first come first served;
    so a light tenant of its class arriving after 40 of the flood's waiting requests has the very next
    sequence that frees."""
    classes = [PriorityClassConfig(name="standard")]

    async def run() -> None:
        queue = FlowQueue(lambda: 64, classes, running=lambda: 32)
        flood = [asyncio.ensure_future(queue.enter(60, 0, "flood", 1.0, 100)) for _ in range(72)]
        await until(lambda: queue.dispatched == 32 and queue.depth == 40)
        light = asyncio.ensure_future(queue.enter(60, 0, "light", 1.0, 100))
        await asyncio.sleep(0)
        assert not light.done() and queue.dispatched == 32, "no 33rd sequence, whoever asks"
        queue.leave()
        assert await asyncio.wait_for(light, 1), "the next sequence that frees is the light tenant's"
        for f in flood:
            f.cancel()

    _run(run())


def test_a_tenant_leaves_its_class_a_sequence_free_while_another_tenant_of_the_class_is_present():
    """Issue 52: a flood's sequences of one length end together, so a light tenant of its class would wait for
    the whole wave. Alone, the flood fills the 32 sequences; once the light tenant came (within hold_s), the
    flood fills at most 30 of them (1/16 kept, at least one) and the light tenant's next request starts at
    once; 30 s after its last arrival, the flood may fill all 32 again."""
    from tests.unit.fake_clock import Clock

    async def run() -> None:
        clock = Clock(100.0)
        queue = FlowQueue(lambda: 64, [shares()], running=lambda: 32, hold_s=30, clock=clock,
                          tenant_headroom=1 / 16)
        flood = [await queue.enter(5, 0, "flood") for _ in range(32)]
        assert all(flood) and queue.dispatched == 32, "alone in its class, the flood fills every sequence"
        more = [asyncio.ensure_future(queue.enter(60, 0, "flood")) for _ in range(10)]
        light = asyncio.ensure_future(queue.enter(5, 0, "light"))
        await asyncio.sleep(0)
        assert not light.done(), "every sequence runs: the first light request waits for one to end"
        flood.pop().leave()
        light_turn = await asyncio.wait_for(light, 1)
        assert light_turn is not None, "and has the first that does (its fair-queue tag is the smallest)"
        light_turn.leave()
        assert queue.dispatched == 31 and not any(m.done() for m in more), "the sequence it freed stays free"
        flood.pop().leave()
        await asyncio.sleep(0)
        assert queue.dispatched == 30 and not any(m.done() for m in more), "the flood holds 30 at most now"
        again = await asyncio.wait_for(queue.enter(5, 0, "light"), 1)
        assert again is not None and queue.dispatched == 31, "so the light tenant's next request starts at once"
        again.leave()
        clock.now += 31  # the light tenant quiet for longer than hold_s
        flood.pop().leave()
        await until(lambda: sum(m.done() for m in more) == 3)
        assert queue.dispatched == 32, "and the flood may fill every sequence again"
        for m in more:
            m.cancel()

    _run(run())


def test_a_tenant_held_back_by_the_headroom_does_not_hold_back_another_tenant_behind_it():
    """Two heavy tenants of a class: the one whose next request is first in tag order may take no more (it holds
    all but the kept sequences); the other's request, behind it, goes."""

    async def run() -> None:
        queue = FlowQueue(lambda: 8, [shares()], tenant_headroom=0.25)
        a = [await queue.enter(5, 0, "a", 1.0, 1) for _ in range(6)]
        assert await queue.enter(5, 0, "b", 1.0, 1000) and queue.dispatched == 7
        a_next = asyncio.ensure_future(queue.enter(5, 0, "a", 1.0, 1))
        b_next = asyncio.ensure_future(queue.enter(5, 0, "b", 1.0, 1000))  # a later tag than a's next
        await asyncio.sleep(0)
        assert all(a) and queue.depth_of(0) == 1
        assert b_next.done() and b_next.result() is not None, "b's request goes past a's, which may not"
        assert not a_next.done()
        a_next.cancel()

    _run(run())


async def _waits_for_a_free_sequence(queue: FlowQueue, pending: asyncio.Future, freed, why: str):
    """`pending` (an entering request) waits while the sequences it needs are taken; once `freed` is let go,
    it has its turn. Returns its charge."""
    await asyncio.sleep(0)
    assert not pending.done(), why
    freed.leave()
    charge = await asyncio.wait_for(pending, 1)
    assert charge is not None
    return charge


def test_a_request_holds_the_sequences_it_makes_and_one_larger_than_the_limit_goes_alone():
    """`n` choices or a batch's inputs are that many engine sequences: 8 running, a request of 5 and one of 4
    do not fit together; one of 20 waits until nothing else runs, then goes, and holds all 20 until it ends."""

    async def run() -> None:
        queue = FlowQueue(lambda: 64, running=lambda: 8)
        five = await queue.enter(5, slots=5)
        assert five is not None and queue.dispatched == 5
        four = asyncio.ensure_future(queue.enter(5, slots=4))
        four_charge = await _waits_for_a_free_sequence(queue, four, five, "5 + 4 is more than the 8 the engine runs")
        assert queue.dispatched == 4
        big = asyncio.ensure_future(queue.enter(5, slots=20))
        big_charge = await _waits_for_a_free_sequence(queue, big, four_charge, "larger than the limit: only alone")
        assert queue.dispatched == 20
        one = asyncio.ensure_future(queue.enter(0.05))
        assert await one is None, "the big one holds every sequence until it ends"
        big_charge.leave()
        assert queue.dispatched == 0

    _run(run())


def _closed_loops(refund: bool) -> list[str]:
    """Two tenants of one class, three requests each always waiting or running on one slot: `heavy` is
    charged 2,000 tokens a request (it sends no max_tokens), `light` 20, and each really uses 20. Returns who
    was served, in order."""

    async def run() -> list[str]:
        queue, served = FlowQueue(lambda: 1), []

        async def worker(tenant: str, cost: float) -> None:
            while len(served) < 60:
                charge = await queue.enter(5, 0, tenant, 1.0, cost)
                assert charge is not None
                served.append(tenant)
                await asyncio.sleep(0)  # the request runs
                queue.leave()
                if refund:
                    charge.refund(20)

        await asyncio.gather(*(worker(t, c) for t, c in (("heavy", 2000), ("light", 20)) for _ in range(3)))
        return served[:60]

    return _run(run())


def test_a_charge_is_corrected_by_what_was_used_so_leaving_out_max_tokens_costs_no_share():
    """Issue 52, item 4: charged by what a request may use, a tenant that sends no max_tokens got about a
    hundredth of the turns of one asking for 20; corrected by what each used, the two share the slot."""
    uncorrected, corrected = _closed_loops(refund=False), _closed_loops(refund=True)
    assert uncorrected.count("heavy") <= 6, uncorrected
    assert 25 <= corrected.count("heavy") <= 35, corrected


def test_a_request_that_leaves_unserved_gives_its_whole_charge_back():
    async def run() -> tuple[float, float]:
        queue = FlowQueue(lambda: 1)
        assert await queue.enter(1, 0, "other", 1.0, 1.0)  # holds the slot
        before = queue._queues[0].start_tag("t")
        assert not await queue.enter(0.05, 0, "t", 1.0, 500.0), "timed out waiting"
        after_timeout = queue._queues[0].start_tag("t")
        waiting = asyncio.ensure_future(queue.enter(5, 0, "t", 1.0, 500.0))
        await until(lambda: queue.depth == 1)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert queue._queues[0].start_tag("t") == before
        return before, after_timeout

    before, after_timeout = _run(run())
    assert after_timeout == before, "the timed-out request's 500 tokens are not held against its tenant"


def test_a_tenants_place_in_its_class_counts_only_the_requests_its_next_tag_would_not_go_before():
    async def run() -> None:
        queue = FlowQueue(lambda: 1, [shares(), shares()])
        await _hold(queue, 1)
        order: list[str] = []
        waiting = await _queue_up(queue, [("flood", {"rank": 1, "tenant": "flood", "cost": 10})] * 6
                                  + [("urgent", {"rank": 0, "tenant": "u"})], order)
        assert queue.waiting_of(1, "flood") == 6 and queue.waiting_of(1, "light") == 0
        # The one slot is taken (+1): everyone waiting in its class and above, then that slot
        assert queue.ahead_of(1) == 8
        assert queue.ahead_of(1, "light") == 3, "a fresh tenant goes after the urgent one and the flood's head"
        assert queue.ahead_of(1, "flood") == 8, "the flood's next request goes after its own six"
        await _drain(queue, waiting)

    _run(run())


def test_a_class_alone_fills_every_running_sequence_and_gives_its_headroom_back_when_urgent_work_comes():
    """Issue 52 item 2: batch's share holds only while more urgent work is there or arrived within hold_s."""
    from tests.unit.fake_clock import Clock

    async def run() -> None:
        clock = Clock(100.0)
        queue = FlowQueue(lambda: 16, [shares(), shares(capacity_share=0.5)], running=lambda: 8, hold_s=30,
                          clock=clock)
        batch = [await asyncio.wait_for(queue.enter(timeout_s=5, rank=1), 1) for _ in range(8)]
        assert all(batch) and queue.dispatched == 8, "alone, batch takes all 8 running sequences"
        assert not await queue.enter(timeout_s=0.05, rank=1), "but never more: a 9th would queue in the engine"
        urgent = asyncio.ensure_future(queue.enter(timeout_s=5, rank=0))
        await asyncio.sleep(0)
        assert not urgent.done(), "an urgent arrival waits for a running sequence to end, here, not in the engine"
        queue.leave(1)
        assert await asyncio.wait_for(urgent, 1), "and has the first that does"
        queue.leave(0)
        for _ in range(4):
            queue.leave(1)
        assert queue.dispatched == 3
        assert await asyncio.wait_for(queue.enter(timeout_s=5, rank=1), 1), "3 of batch's 4 held: one more"
        assert not await queue.enter(timeout_s=0.05, rank=1), "urgent work arrived 0 s ago: back to half"
        clock.now += 31
        assert await asyncio.wait_for(queue.enter(timeout_s=5, rank=1), 1), "30 s quiet: the whole engine again"
        held = FlowQueue(lambda: 16, [shares(), shares(capacity_share=0.5)], running=lambda: 8, clock=clock)
        assert [await held.enter(timeout_s=0.05, rank=1) is not None for _ in range(5)] == [True] * 4 + [False], \
            "hold_s None: the share always holds"

    _run(run())
