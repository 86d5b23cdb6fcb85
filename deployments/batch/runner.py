"""The Batch API's runner: every batch not yet ended, carried from its input file to its result files.

One runner per cluster, in the head node's BatchService. It keeps nothing that matters in memory: a batch's
status and each line's outcome are in the store (shunter.batch_store), so a runner started again (the
replica replaced, the app redeployed) carries on where the last one stopped, and a line whose outcome was
written is never run again. A line that ran but whose outcome was lost with its runner runs again; its
usage reaches the ledger under the same id (`<batch>-<line>`), which the ledger records once.

Each batch, in OpenAI's statuses:
- `validating`: the input file read into lines (a file that cannot run at all fails the batch), and each
  line checked by a gateway as its endpoint would check it; a line refused there is that line's error line,
  and the batch runs the others.
- `in_progress`: lines run through a gateway (`LineRunner.run`), in the least urgent priority class, at most
  `max_lines_in_flight` at once and `max_lines_in_flight_per_key` per key; the keys with lines to run take
  turns. A line the platform could not take yet (its model full, the key's rate, no replica, the gateway
  gone) waits and runs again, and counts as nothing; a server error is tried `MAX_TRIES` times; any other
  answer is the line's outcome.
- `finalizing`: the result files written (an output file of the 200s, an error file of the rest), under ids
  derived from the batch's, so a runner that died while writing them writes the same ones again.
- `cancelling` / the window passed: no new line starts; once the running ones end, every line not run is an
  error line (`batch_cancelled`, `batch_expired`) and the files are written: every input line has exactly
  one result line, whatever way the batch ends.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from shunter.batch_files import BatchInputError, FileBlobs, error_line, jsonl, read_input, result_line
from shunter.batch_store import Batch, JobStore, PendingLine
from shunter.deployments.batch import metrics

log = logging.getLogger("ray.serve")

TICK_S = 1.0  # the longest the runner sleeps without being woken (a batch created, a line ended)
MAX_TRIES = 3  # a line answered with a server error (5xx) is tried this often before that answer stands
CHECK_CHUNK = 256  # lines checked by a gateway per call
VALIDATE_AGAIN_S = 5.0  # after a validation that could not finish (no gateway yet)
PAUSE_S = (0.5, 30.0)  # how long a batch waits after the platform could not take its line: at least, at most
WAITS = {429, 503}  # answers that say "not now": the line runs again later (but a request past the key's budget)
NEVER_FITS = "request_exceeds_quota"


class LineRunner(Protocol):
    """A gateway, as the runner uses it (shunter.deployments.gateway.batch_lines)."""

    async def check(self, owner: str, url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any] | None]: ...

    async def run(self, owner: str, url: str, body: dict[str, Any], line_id: str) -> dict[str, Any]: ...


@dataclass(frozen=True)
class RunnerLimits:
    max_lines: int  # lines a batch input file may hold
    in_flight: int  # lines running at once, every key's
    per_key: int  # lines of one key's batches running at once


class BatchRunner:
    def __init__(self, store: JobStore, blobs: FileBlobs, gateway: LineRunner, limits: RunnerLimits,
                 clock: Callable[[], float] = time.time):
        self.store, self.blobs, self.gateway, self.limits, self.clock = store, blobs, gateway, limits, clock
        self._wake = asyncio.Event()
        self._running: dict[str, set[int]] = defaultdict(set)  # batch -> lines running now
        self._by_owner: dict[str, int] = defaultdict(int)  # key -> its lines running now
        self._paused: dict[str, float] = {}  # batch -> when its next line may start (the platform said "not now")
        self._line_later: dict[tuple[str, int], float] = {}  # a line after a server error: when it may run again
        self._tries: dict[tuple[str, int], int] = defaultdict(int)  # server errors per line, this runner's
        self._validating: set[str] = set()
        self._lines: dict[tuple[str, int], asyncio.Task] = {}  # the lines running now
        self._turn = 0  # which key goes first this round
        self._tasks: set[asyncio.Task] = set()

    def wake(self) -> None:
        self._wake.set()

    async def run_forever(self) -> None:
        while True:
            self._wake.clear()  # before the step: a wake during it makes the next one start at once
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - the store briefly unreachable: the next tick tries again
                log.exception("the batch runner's step failed; trying again in %gs", TICK_S)
            try:
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            except TimeoutError:
                pass

    async def step(self) -> None:
        """One look at every batch not yet ended: validate, start lines, end what is done."""
        batches = await asyncio.to_thread(self.store.active_batches)
        now = self.clock()
        runnable: list[Batch] = []
        for batch in batches:
            running = bool(self._running.get(batch.id))
            if batch.status in ("in_progress", "cancelling"):
                metrics.progress(batch.id, batch.owner, _pending(batch), len(self._running.get(batch.id, ())))
            if batch.status == "validating":
                if batch.id in self._validating:
                    continue
                if now >= batch.expires_at:  # never validated (no gateway all along): nothing ran
                    await self._end(batch, "expired", "batch_expired",
                                    "the batch's completion window ended before this request ran")
                elif self._paused.get(batch.id, 0) <= now:
                    self._spawn(self._validate(batch))
            elif batch.status == "cancelling":
                self._stop_lines(batch.id)  # cancelled, the running lines are cut short too
                if not running and batch.id not in self._validating:
                    await self._end(batch, "cancelled", "batch_cancelled",
                                    "the batch was cancelled before this request ran")
            elif batch.status == "finalizing":
                await self._finish(batch, "finalizing", "completed")
            elif _pending(batch) == 0:
                if not running and await asyncio.to_thread(self.store.set_status, batch.id, "finalizing",
                                                           ("in_progress",)):
                    await self._finish(batch, "finalizing", "completed")
            elif now >= batch.expires_at:  # in_progress past its window: nothing new starts
                if not running:
                    await self._end(batch, "expired", "batch_expired",
                                    "the batch's completion window ended before this request ran")
            elif self._paused.get(batch.id, 0) <= now:
                runnable.append(batch)
        await self._start_lines(runnable, now)

    # ---- running lines ------------------------------------------------------------------------------

    async def _start_lines(self, batches: list[Batch], now: float) -> None:
        """Fill the free slots, the keys taking turns: each key's oldest batch first, one line a turn."""
        free = self.limits.in_flight - sum(self._by_owner.values())
        if free <= 0 or not batches:
            return
        queued: dict[str, deque[tuple[Batch, PendingLine]]] = defaultdict(deque)
        for batch in batches:  # oldest first
            room = min(free, self.limits.per_key - self._by_owner[batch.owner] - len(queued[batch.owner]))
            if room <= 0:
                continue
            waiting = {line for (b, line), at in self._line_later.items() if b == batch.id and at > now}
            lines = await asyncio.to_thread(self.store.pending_lines, batch.id, room,
                                            self._running[batch.id] | waiting)
            queued[batch.owner].extend((batch, line) for line in lines)
        owners = [o for o in queued if queued[o]]
        if not owners:
            return
        self._turn = (self._turn + 1) % len(owners)
        owners = owners[self._turn:] + owners[:self._turn]
        while free > 0 and owners:
            for owner in list(owners):
                if free <= 0:
                    break
                if not queued[owner]:
                    owners.remove(owner)
                    continue
                batch, line = queued[owner].popleft()
                self._running[batch.id].add(line.line)
                self._by_owner[owner] += 1
                free -= 1
                self._lines[(batch.id, line.line)] = self._spawn(self._run_line(batch, line))

    async def _run_line(self, batch: Batch, line: PendingLine) -> None:
        try:
            await asyncio.to_thread(self.store.started_line, batch.id, line.line)
            try:
                # The usage ledger's id: the same for a line run again after its runner died (charged once),
                # its own for each try after a server error (each charged what it used).
                tries = self._tries.get((batch.id, line.line), 0)
                line_id = f"{batch.id}-{line.line}" + (f".{tries}" if tries else "")
                answer = await self.gateway.run(batch.owner, batch.endpoint, line.request, line_id)
            except Exception as exc:  # noqa: BLE001 - the gateway replica died or was not reachable: not the line's fault
                log.warning("batch %s line %d: no answer from a gateway (%s); it runs again", batch.id, line.line,
                            f"{type(exc).__name__}: {exc}"[:200])
                self._pause(batch.id, None)
                return
            await self._settle(batch, line, answer)
        finally:
            self._lines.pop((batch.id, line.line), None)
            self._running[batch.id].discard(line.line)
            self._by_owner[batch.owner] -= 1
            self.wake()

    async def _settle(self, batch: Batch, line: PendingLine, answer: dict[str, Any]) -> None:
        status, code, key = int(answer["status"]), answer.get("code"), (batch.id, line.line)
        if status in WAITS and code != NEVER_FITS:
            self._pause(batch.id, answer.get("retry_after"))
            return
        if status >= 500:
            self._tries[key] += 1
            if self._tries[key] < MAX_TRIES:
                self._line_later[key] = self.clock() + PAUSE_S[0] * 2 ** self._tries[key]
                return
        self._tries.pop(key, None)
        self._line_later.pop(key, None)
        result = result_line(batch.id, line.line, line.custom_id, status, answer.get("body"),
                             answer.get("request_id") or f"{batch.id}-{line.line}")
        if await asyncio.to_thread(self.store.finish_line, batch.id, line.line, result, status == 200):
            metrics.finished(batch.id, batch.owner, status == 200)

    def _pause(self, batch_id: str, retry_after: Any) -> None:
        try:
            wait = float(retry_after) if retry_after is not None else PAUSE_S[0]
        except ValueError:
            wait = PAUSE_S[0]
        wait = min(max(wait, PAUSE_S[0]), PAUSE_S[1])
        self._paused[batch_id] = max(self._paused.get(batch_id, 0), self.clock() + wait)

    # ---- validating -----------------------------------------------------------------------------------

    async def _validate(self, batch: Batch) -> None:
        self._validating.add(batch.id)
        try:
            if not await asyncio.to_thread(self.store.has_lines, batch.id):
                if not await self._read_lines(batch):
                    return
            await asyncio.to_thread(self.store.set_status, batch.id, "in_progress", ("validating",))
        except Exception as exc:  # noqa: BLE001 - no gateway yet (the app starting), the store away
            log.warning("batch %s: validation did not finish (%s); trying again in %gs", batch.id,
                        f"{type(exc).__name__}: {exc}"[:300], VALIDATE_AGAIN_S)
            self._pause(batch.id, VALIDATE_AGAIN_S)
        finally:
            self._validating.discard(batch.id)
            self.wake()

    async def _read_lines(self, batch: Batch) -> bool:
        """The batch's lines stored (each line's request, or its error line); False when the batch failed."""
        stored = await asyncio.to_thread(self.store.get_file, batch.input_file_id, batch.owner)
        if stored is None:
            await self._fail(batch, "file_not_found", f"the input file {batch.input_file_id} was deleted")
            return False
        content = await asyncio.to_thread(self.blobs.get, batch.input_file_id)
        try:
            lines = read_input(content, batch.endpoint, self.limits.max_lines)
        except BatchInputError as exc:
            await self._fail(batch, exc.code, str(exc))
            return False
        valid = [line for line in lines if line.valid]
        verdicts: dict[int, dict[str, Any] | None] = {}
        for start in range(0, len(valid), CHECK_CHUNK):
            chunk = valid[start:start + CHECK_CHUNK]
            found = await self.gateway.check(batch.owner, batch.endpoint, [line.body for line in chunk])
            verdicts.update(zip((line.line for line in chunk), found, strict=True))
        rows = []
        for line in lines:
            refusal = verdicts.get(line.line)
            if not line.valid:
                assert line.error is not None
                rows.append((line.line, line.custom_id, None,
                             error_line(batch.id, line.line, line.custom_id, line.error["code"], line.error["message"])))
            elif refusal is not None:
                rows.append((line.line, line.custom_id, None,
                             result_line(batch.id, line.line, line.custom_id, int(refusal["status"]), refusal["body"],
                                         f"{batch.id}-{line.line}")))
            else:
                rows.append((line.line, line.custom_id, line.body, None))
        await asyncio.to_thread(self.store.add_lines, batch.id, rows)
        metrics.finished(batch.id, batch.owner, False, sum(1 for row in rows if row[3] is not None))
        return True

    async def _fail(self, batch: Batch, code: str, message: str) -> None:
        log.warning("batch %s failed: %s", batch.id, message)
        await asyncio.to_thread(self.store.set_status, batch.id, "failed", ("validating",),
                                errors=[{"code": code, "message": message, "param": "input_file_id", "line": None}])

    # ---- ending ---------------------------------------------------------------------------------------

    async def _end(self, batch: Batch, status: str, code: str, message: str) -> None:
        """Cancelled or expired: every line not run gets its error line, then the files."""
        ended = await asyncio.to_thread(self.store.finish_pending, batch.id,
                                        lambda line, custom_id: error_line(batch.id, line, custom_id, code, message))
        metrics.finished(batch.id, batch.owner, False, ended)
        await self._finish(batch, batch.status, status)

    async def _finish(self, batch: Batch, current: str, status: str) -> None:
        """The result files, then the batch's last status (from `current`, its status now)."""
        output = await self._result_file(batch, "output", True)
        errors = await self._result_file(batch, "error", False)
        if await asyncio.to_thread(self.store.set_status, batch.id, status, (current,),
                                   output_file_id=output, error_file_id=errors):
            counts = await asyncio.to_thread(self.store.counts, batch.id)
            log.info("batch %s %s: %s", batch.id, status, counts)
        metrics.ended(batch.id)
        self._forget(batch.id)

    async def _result_file(self, batch: Batch, kind: str, ok: bool) -> str | None:
        """The batch's output (`ok`) or error file, written once: its id is derived from the batch's, so a
        runner that died while writing finds it (or writes the same) and a finished batch never has two."""
        file_id = "file-" + hashlib.sha256(f"{batch.id}:{kind}".encode()).hexdigest()[:24]
        if await asyncio.to_thread(self.store.get_file, file_id, None) is not None:
            return file_id
        rows = await asyncio.to_thread(self.store.results, batch.id, ok)
        if not rows:
            return None
        content = jsonl(list(rows))
        await asyncio.to_thread(self.blobs.put, file_id, content)
        await asyncio.to_thread(self.store.add_file, batch.owner, f"{batch.id}_{kind}.jsonl", "batch_output",
                                len(content), file_id)
        return file_id

    def _forget(self, batch_id: str) -> None:
        self._paused.pop(batch_id, None)
        self._running.pop(batch_id, None)
        for key in [k for k in self._tries if k[0] == batch_id]:
            self._tries.pop(key, None)
        for key in [k for k in self._line_later if k[0] == batch_id]:
            self._line_later.pop(key, None)

    def _stop_lines(self, batch_id: str) -> None:
        for (running_batch, _), task in list(self._lines.items()):
            if running_batch == batch_id:
                task.cancel()

    def _spawn(self, work: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _pending(batch: Batch) -> int:
    counts = batch.counts
    return counts["total"] - counts["completed"] - counts["failed"]
