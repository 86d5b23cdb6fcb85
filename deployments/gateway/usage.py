"""Usage per tenant, from the gateway: one ledger record per settled request, sent in batches off the request
path, and the per-key usage and cost metrics.

`record_usage` is the last end-of-request hook (shunter.deployments.gateway.request_end, after `quota`): it
turns the request's outcome into one `UsageRecord` holding exactly what its key was charged (the quota
ticket's own figures: nothing for a request that never reached an engine, the estimated prompt for a stream
cut before the engine reported any usage), adds the Prometheus counters, and appends the record to the
gateway's `UsageWriter`. `RequestEnd.settle` runs each hook once, so each settled request is one record.

The platform's own requests (the tier monitor's comparisons, `ctx.caller is None`) are recorded too, under
key name "": they use engine time no tenant is billed for, and an operator should see what that costs.

Refusals are counted, not recorded one by one: a record that used nothing and did not succeed
(`UsageRecord.refusal`: a 429, a 499 or 503 in the queue) adds one to the writer's counter of its minute and
kind (key, model, adapter, class, endpoint, status), sent as one record whose `requests` is the count so far,
under an id of the counter's own (`refused:<writer>:<minute>:<n>`); the ledger keeps its largest count, so a
flood of 429s costs the ledger a row per minute and kind, and a resent batch still counts once. A counter is
forgotten once its minute is over and its count reached the ledger. Its id has a serial of its own, not the
kind alone: a counter forgotten early (the memory bound below) and started again must not lose its new,
smaller count to the old row's larger one.

`UsageWriter` only appends on the request path (a bounded deque, and the counters). A background task on the gateway's event
loop, started by the first record, sends what accumulated every `usage.flush_interval_s`, in batches of at
most `usage.max_batch_records`, to the ledger deployment (shunter.deployments.ledger). A batch that fails
(the ledger restarting, unreachable, slow past the send timeout) is kept and sent again on the next tick,
first; the ledger skips request ids it already holds, so a batch whose reply was lost is counted once.
While the ledger is unreachable the buffer and the counters hold at most `usage.max_buffered_records` entries
(plus the batch being sent); past that a counter whose count is all in the ledger is forgotten first, then the
oldest record is dropped (or, with no record left, the oldest counter), and what is lost is counted
(`shunter_usage_records_dropped_total`: requests, a counter's unsent part). The gateway flushes before it
stops (its Serve destructor, after its requests drained) and before it answers /admin/usage or the Usage API
(shunter.deployments.gateway.usage_routes), so a caller sees its own settled requests at once; other
gateways' records arrive within their flush interval.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from shunter.config import UsageConfig
from shunter.deployments.gateway.context import Outcome, RequestContext
from shunter.metric_catalog import build
from shunter.ray_metrics import LazyMetrics
from shunter.usage_ledger import UsageRecord, cost_of

log = logging.getLogger("ray.serve")

_NAMES = ("shunter_usage_tokens_total", "shunter_usage_cost_total", "shunter_usage_records_dropped_total")
_record = LazyMetrics(lambda metrics: build(metrics, _NAMES)).record

SEND_TIMEOUT_S = 10.0  # one batch's call to the ledger; past it the batch is kept and sent again
PLATFORM_KEY = ""  # the key name of the platform's own requests (the tier monitor)
_WARN_EVERY_S = 60.0


class EndedRequest(Protocol):
    """What the hook reads of a request's end: shunter.deployments.gateway.request_end.RequestEnd, named by
    its shape (that module registers the hook, so importing it here would be a circle)."""

    ctx: RequestContext
    turn: Any  # the flow queue whose turn it had (None: it never had one)
    reply: Any  # the replica's reply (None: no replica answered)


@dataclass
class _Counter:
    """One minute's refusals of one kind: `record` stamped with the minute's start and the counter's id."""

    record: UsageRecord
    count: int = 0
    sent: int = 0  # the largest count the ledger has taken

    def snapshot(self) -> UsageRecord:
        return replace(self.record, requests=self.count)


def _kind(r: UsageRecord) -> tuple[Any, ...]:
    """A refusal counter's key: its minute and what it is a count of."""
    return (int(r.at // 60) * 60, r.key_name, r.key_id, r.model, r.adapter, r.priority_class, r.endpoint, r.status)


class UsageWriter:
    """A gateway's buffer of usage records and refusal counters, and the task that sends them to the ledger;
    see the module docstring. `ledger`: the UsageLedger deployment's handle (anything with
    `.record.remote(list[dict])` and `.query.remote(...)` returning awaitables). `clock` times the warnings,
    `wall` (unix seconds) tells when a counter's minute is over."""

    def __init__(self, config: UsageConfig, ledger: Any, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.config, self.ledger, self._clock, self._wall = config, ledger, clock, wall
        self.writer_id = uuid.uuid4().hex[:12]  # per gateway process: its counters' ids are its own
        self._serial: Iterator[int] = itertools.count()
        self._counters: dict[tuple[Any, ...], _Counter] = {}  # oldest first
        self._buffer: deque[UsageRecord] = deque()
        self._sending: list[UsageRecord] = []  # the batch in flight, or the one that failed, sent first
        self._lock = asyncio.Lock()  # one sender at a time: the ticker or a flush
        self._task: asyncio.Task[None] | None = None
        self._warned_at = -_WARN_EVERY_S
        self.dropped = 0
        self.sent = 0

    @property
    def pending(self) -> int:
        """Records not yet in the ledger (a counter with an unsent count is one)."""
        return len(self._buffer) + len(self._sending) + sum(1 for c in self._counters.values() if c.count > c.sent)

    @property
    def held(self) -> int:
        """Entries in memory: buffered records and counters (what `usage.max_buffered_records` bounds)."""
        return len(self._buffer) + len(self._counters)

    # ---- the request path ------------------------------------------------------------------------

    def add(self, record: UsageRecord) -> None:
        """Buffer one record, or count one refusal (the oldest dropped, and counted, past the bound), and make
        sure the sending task runs. Never waits and never raises for the ledger."""
        if record.refusal:
            kind = _kind(record)
            counter = self._counters.get(kind)
            if counter is None:
                self._make_room()
                counter = self._counters[kind] = _Counter(replace(
                    record, at=float(kind[0]), request_id=f"refused:{self.writer_id}:{kind[0]}:{next(self._serial)}"))
            counter.count += 1
        else:
            self._make_room()
            self._buffer.append(record)
        self._start()

    def _make_room(self) -> None:
        if self.held < self.config.max_buffered_records:
            return
        oldest = next(iter(self._counters), None)
        if oldest is not None and self._counters[oldest].count <= self._counters[oldest].sent:
            del self._counters[oldest]  # all of it is in the ledger: forgetting it loses nothing
            return
        if self._buffer:
            self._buffer.popleft()
            lost = 1
        else:
            counter = self._counters.pop(oldest)  # type: ignore[arg-type] - held > 0 and no record: a counter
            lost = counter.count - counter.sent
        self.dropped += lost
        _record(lambda m: m["shunter_usage_records_dropped_total"].inc(lost))

    def _start(self) -> None:
        if self._task is not None and not self._task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # off the loop (a test, a thread): the next record or flush on it starts it
            return
        self._task = loop.create_task(self._run(), name="shunter-usage-writer")

    # ---- sending ---------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.flush_interval_s)
            try:
                await self._send_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the task never ends on a bug; the records stay buffered
                log.warning("usage writer: sending failed unexpectedly", exc_info=True)

    async def _send_all(self) -> bool:
        """Send everything buffered and every counter's new count, batch by batch; stop at the first failure
        (kept for the next try). True when nothing is left."""
        async with self._lock:
            while True:
                if not self._sending:
                    count = min(len(self._buffer), self.config.max_batch_records)
                    self._sending = [self._buffer.popleft() for _ in range(count)]
                    room = self.config.max_batch_records - count
                    if room:
                        changed = (c.snapshot() for c in self._counters.values() if c.count > c.sent)
                        self._sending.extend(itertools.islice(changed, room))
                    if not self._sending:
                        break
                if not await self._send(self._sending):
                    return False
                self.sent += len(self._sending)
                self._counted(self._sending)
                self._sending = []
            minute = int(self._wall() // 60) * 60
            for kind in [k for k, c in self._counters.items() if k[0] < minute and c.sent >= c.count]:
                del self._counters[kind]  # its minute is over and all of it is in the ledger
            return True

    def _counted(self, batch: list[UsageRecord]) -> None:
        """The ledger took these: each counter among them has its count there now."""
        for r in batch:
            if r.refusal:
                counter = self._counters.get(_kind(r))
                if counter is not None and counter.record.request_id == r.request_id:  # not one started again
                    counter.sent = max(counter.sent, r.requests)

    async def _send(self, batch: list[UsageRecord]) -> bool:
        try:
            await asyncio.wait_for(self.ledger.record.remote([r.to_dict() for r in batch]), SEND_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the ledger restarting or unreachable: kept, sent again
            now = self._clock()
            if now - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = now
                log.warning("usage ledger unreachable (%s: %s); %d record(s) kept to send again", type(exc).__name__,
                            exc, self.pending)
            return False
        return True

    async def flush(self, timeout_s: float = 2.0) -> bool:
        """Send everything buffered now (before /admin/usage answers, and when the gateway stops). True when
        all of it reached the ledger within `timeout_s`; what did not stays buffered."""
        try:
            return await asyncio.wait_for(self._send_all(), timeout_s)
        except TimeoutError:
            return False

    async def close(self, timeout_s: float = 2.0) -> bool:
        """The gateway stops: flush, then stop the sending task."""
        done = await self.flush(timeout_s)
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if not done:
            log.warning("usage writer: %d record(s) did not reach the ledger before the gateway stopped",
                        self.pending)
        return done

    # ---- reading ---------------------------------------------------------------------------------

    async def query(self, key: str | None, model: str | None, since: float | None, until: float | None,
                    group_by: Sequence[str], timeout_s: float = SEND_TIMEOUT_S) -> list[dict[str, Any]]:
        return await asyncio.wait_for(
            self.ledger.query.remote(key=key, model=model, since=since, until=until, group_by=list(group_by)),
            timeout_s)


    async def buckets(self, since: float, until: float, width_s: int, group_by: Sequence[str], key: str | None,
                      key_ids: Sequence[str] | None, models: Sequence[str] | None,
                      timeout_s: float = SEND_TIMEOUT_S) -> list[dict[str, Any]]:
        """The Usage API's sums per bucket (shunter.usage_ledger.LedgerStore.buckets)."""
        return await asyncio.wait_for(
            self.ledger.buckets.remote(since=since, until=until, width_s=width_s, group_by=list(group_by), key=key,
                                       key_ids=None if key_ids is None else list(key_ids),
                                       models=None if models is None else list(models)), timeout_s)


def usage_record(end: EndedRequest, outcome: Outcome, now: Callable[[], float] = time.time) -> UsageRecord:
    """The request's record: the tokens its key was charged (the quota ticket's figures once it settled; the
    same rule without a ticket: nothing unless it reached an engine), priced by its model's `pricing`."""
    ctx = end.ctx
    usage = ctx.usage
    charged = getattr(ctx.ticket, "charged", None) if ctx.ticket is not None else None
    dispatched = end.turn is not None or end.reply is not None
    if charged is not None:
        prompt, completion = charged
    elif dispatched:
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
    else:
        prompt = completion = 0
    cached = min(usage.cached_tokens or 0, prompt)
    caller = ctx.caller
    return UsageRecord(
        # A batch line's run is recorded under the line's id (one record however often it ran); a try refused
        # before any replica took it, under its own (the ledger keeps the first record of an id).
        request_id=ctx.ledger_id if ctx.ledger_id and dispatched else ctx.routing_id, at=now(),
        key_name=caller.name if caller is not None else PLATFORM_KEY,
        key_id=caller.key_id if caller is not None else PLATFORM_KEY,
        model=ctx.model.name, adapter=ctx.adapter.name if ctx.adapter is not None else "",
        priority_class=ctx.priority_class, endpoint=ctx.endpoint.name, status=str(outcome.status),
        prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
        cost=cost_of(ctx.model.pricing, prompt, cached, completion, ctx.price_multiplier))


def record_usage(writer: UsageWriter | None) -> Callable[[EndedRequest, Outcome], None]:
    """The `usage` end-of-request hook: the metrics, and the record for the ledger (none without a writer:
    `usage.enabled: false`)."""

    def hook(end: EndedRequest, outcome: Outcome) -> None:
        record = usage_record(end, outcome)
        _count(record)
        if writer is not None:
            writer.add(record)

    return hook


def _count(r: UsageRecord) -> None:
    labels = {"key_name": r.key_name, "model": r.model, "adapter": r.adapter, "priority_class": r.priority_class}

    def count(m: dict[str, Any]) -> None:
        for kind, tokens in (("prompt", r.prompt_tokens), ("cached", r.cached_tokens),
                             ("completion", r.completion_tokens)):
            if tokens:
                m["shunter_usage_tokens_total"].inc(tokens, tags={**labels, "kind": kind})
        if r.cost:
            m["shunter_usage_cost_total"].inc(r.cost, tags=labels)

    _record(count)
