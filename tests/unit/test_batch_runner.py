"""The batch runner (shunter.deployments.batch.runner) over a real SQLite store and real file folder, with
a scripted stand-in for the gateway (named as such: the runner's own decisions are under test here; the
e2e tests run batches through real gateways and engines): every input line ends with exactly one result
line however the batch ends, "not now" answers wait instead of failing, keys take turns within their caps,
and a runner started again carries on without running a finished line twice."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from shunter.batch_files import FileBlobs
from shunter.batch_store import JobStore
from shunter.deployments.batch.runner import MAX_TRIES, BatchRunner, RunnerLimits

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"


class ScriptedGateway:
    """Stands in for a gateway: refuses at the check a body with `"refuse": true`; answers each run from
    `script` (custom text of the prompt -> list of answers, one per try, the last repeated), else 200."""

    def __init__(self, script: dict[str, list[Any]] | None = None):
        self.script = script or {}
        self.runs: list[tuple[str, str]] = []  # (owner, line_id) in start order
        self.running: dict[str, int] = {}  # owner -> lines in the gateway now
        self.most: dict[str, int] = {}
        self.release: asyncio.Event | None = None  # when set: runs wait for it

    async def check(self, owner, url, bodies):
        return [{"status": 400, "body": {"error": {"message": "no", "code": "refused"}}, "code": "refused",
                 "retry_after": None, "request_id": None} if body.get("refuse") else None for body in bodies]

    async def run(self, owner, url, body, line_id):
        self.runs.append((owner, line_id))
        self.running[owner] = self.running.get(owner, 0) + 1
        self.most[owner] = max(self.most.get(owner, 0), self.running[owner])
        try:
            if self.release is not None:
                await self.release.wait()
            prompt = body["messages"][0]["content"]
            answers = self.script.get(prompt)
            answer = answers.pop(0) if answers and len(answers) > 1 else (answers[0] if answers else 200)
            if isinstance(answer, Exception):
                raise answer
            status = answer
            reply = {"echo": prompt} if status == 200 else {"error": {"message": "x", "code": f"c{status}"}}
            return {"status": status, "body": reply, "retry_after": "0" if status in (429, 503) else None,
                    "code": None if status == 200 else f"c{status}", "request_id": line_id}
        finally:
            self.running[owner] -= 1


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _line(custom_id: str, prompt: str, **extra: Any) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT,
                       "body": {"model": "m", "messages": [{"role": "user", "content": prompt}], **extra}}).encode() + b"\n"


@pytest.fixture
def parts(tmp_path):
    clock = Clock()
    store = JobStore(str(tmp_path / "state.sqlite3"), clock=clock)
    blobs = FileBlobs(str(tmp_path / "files"))
    yield store, blobs, clock
    store.close()


def _submit(store: JobStore, blobs: FileBlobs, owner: str, content: bytes) -> str:
    stored = store.add_file(owner, "in.jsonl", "batch", len(content))
    blobs.put(stored.id, content)
    return store.create_batch(owner, stored.id, CHAT, "24h", 24 * 3600).id


def _runner(parts, gateway, in_flight=4, per_key=2) -> BatchRunner:
    store, blobs, clock = parts
    return BatchRunner(store, blobs, gateway, RunnerLimits(1000, in_flight, per_key), clock=clock)


async def _until_ended(runner: BatchRunner, batch_id: str, clock: Clock, steps: int = 200) -> None:
    for _ in range(steps):
        await runner.step()
        while runner._tasks:
            await asyncio.gather(*list(runner._tasks), return_exceptions=True)
        if runner.store.get_batch(batch_id, None).status in ("completed", "failed", "expired", "cancelled"):
            return
        clock.now += 1  # past any pause
    raise AssertionError(f"batch {batch_id} never ended: {runner.store.get_batch(batch_id, None)}")


async def _steps(runner: BatchRunner, clock: Clock, steps: int, every_s: float) -> None:
    """`steps` runner steps, each run to the end of what it started, the clock `every_s` on after each."""
    for _ in range(steps):
        await runner.step()
        while runner._tasks:
            await asyncio.gather(*list(runner._tasks))
        clock.now += every_s


async def _in_gateway(gateway: ScriptedGateway, count: int) -> None:
    """Until `count` lines are in the gateway (each first records its try in the store, in a thread)."""
    for _ in range(500):
        if sum(gateway.running.values()) == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{gateway.running} in the gateway, not {count}")


def _results(parts, batch_id: str) -> tuple[list[dict], list[dict]]:
    store, blobs, _ = parts
    batch = store.get_batch(batch_id, None)

    def read(file_id):
        return [json.loads(x) for x in blobs.get(file_id).splitlines()] if file_id else []

    return read(batch.output_file_id), read(batch.error_file_id)


def test_every_line_ends_with_one_result_line_and_refusals_are_error_lines(parts):
    store, blobs, clock = parts
    content = (_line("a", "one") + b"not json\n" + _line("b", "two", refuse=True) + _line("a", "dup")
               + _line("c", "three") + _line("d", "broken"))
    gateway = ScriptedGateway({"broken": [400]})
    batch_id = _submit(store, blobs, "k1", content)
    asyncio.run(_until_ended(_runner(parts, gateway), batch_id, clock))
    batch = store.get_batch(batch_id, None)
    assert batch.status == "completed"
    assert batch.counts == {"total": 6, "completed": 2, "failed": 4}
    output, errors = _results(parts, batch_id)
    assert [(r["custom_id"], r["response"]["status_code"], r["response"]["body"]) for r in output] == [
        ("a", 200, {"echo": "one"}), ("c", 200, {"echo": "three"})]
    assert [(r["custom_id"], (r["response"] or {}).get("status_code"), (r["error"] or {}).get("code"))
            for r in errors] == [("", None, "invalid_json_line"), ("b", 400, None), ("a", None, "duplicate_custom_id"),
                                 ("d", 400, None)]
    assert len({r["id"] for r in output + errors}) == 6
    assert sorted(line for _, line in gateway.runs) == [f"{batch_id}-1", f"{batch_id}-5", f"{batch_id}-6"]
    # Written once: the files are the batch's, under ids derived from it, with purpose batch_output.
    assert store.get_file(batch.output_file_id, "k1").purpose == "batch_output"


def test_not_now_answers_wait_and_server_errors_are_tried_then_stand(parts):
    store, blobs, clock = parts
    gateway = ScriptedGateway({"full": [429, 503, 200], "gone": [RuntimeError("replica died"), 200],
                               "bug": [500]})
    batch_id = _submit(store, blobs, "k1", _line("a", "full") + _line("b", "gone") + _line("c", "bug"))
    asyncio.run(_until_ended(_runner(parts, gateway), batch_id, clock))
    output, errors = _results(parts, batch_id)
    assert [r["custom_id"] for r in output] == ["a", "b"]
    assert [(r["custom_id"], r["response"]["status_code"]) for r in errors] == [("c", 500)]
    runs = [line for _, line in gateway.runs]
    assert runs.count(f"{batch_id}-1") == 3 and runs.count(f"{batch_id}-2") == 2  # not now: the same ledger id
    # Each try after a server error is its own ledger record (each charged what it used).
    assert [r for r in runs if r.startswith(f"{batch_id}-3")] == [f"{batch_id}-3"] + [
        f"{batch_id}-3.{n}" for n in range(1, MAX_TRIES)]


def test_keys_take_turns_within_their_caps(parts):
    store, blobs, clock = parts
    gateway = ScriptedGateway()
    big = _submit(store, blobs, "big", b"".join(_line(f"b{i}", f"p{i}") for i in range(12)))
    small = _submit(store, blobs, "small", b"".join(_line(f"s{i}", f"q{i}") for i in range(3)))
    runner = _runner(parts, gateway, in_flight=3, per_key=2)

    async def scenario():
        gateway.release = asyncio.Event()
        await runner.step()  # validates both
        await asyncio.gather(*list(runner._tasks))
        await runner.step()  # starts lines
        await _in_gateway(gateway, 3)
        started = {owner: n for owner, n in gateway.running.items()}
        gateway.release.set()
        while runner._tasks:
            await asyncio.gather(*list(runner._tasks))
        await _until_ended(runner, big, clock)
        await _until_ended(runner, small, clock)
        return started

    started = asyncio.run(scenario())
    assert set(started) == {"big", "small"} and sorted(started.values()) == [1, 2]  # both keys at once, one at its cap
    assert gateway.most["big"] <= 2 and gateway.most["small"] <= 2
    assert store.get_batch(big, None).counts["completed"] == 12


def test_cancel_stops_the_running_lines_and_ends_the_rest_as_cancelled(parts):
    store, blobs, clock = parts
    gateway = ScriptedGateway()
    batch_id = _submit(store, blobs, "k1", b"".join(_line(f"r{i}", f"p{i}") for i in range(6)))
    runner = _runner(parts, gateway)

    async def scenario():
        await runner.step()
        await asyncio.gather(*list(runner._tasks))
        gateway.release = asyncio.Event()  # never set: the lines hang in the gateway
        await runner.step()
        await _in_gateway(gateway, 2)
        assert store.set_status(batch_id, "cancelling", ("in_progress",))
        await runner.step()  # cuts the running lines short
        await asyncio.gather(*list(runner._tasks), return_exceptions=True)
        await _until_ended(runner, batch_id, clock)

    asyncio.run(scenario())
    batch = store.get_batch(batch_id, None)
    assert batch.status == "cancelled" and batch.times["cancelled_at"]
    output, errors = _results(parts, batch_id)
    assert output == [] and [r["error"]["code"] for r in errors] == ["batch_cancelled"] * 6


def test_a_batch_past_its_window_expires_with_what_it_finished(parts):
    store, blobs, clock = parts
    gateway = ScriptedGateway({"slow": [429]})
    batch_id = _submit(store, blobs, "k1", _line("a", "fast") + _line("b", "slow"))
    runner = _runner(parts, gateway)

    async def scenario():
        await _steps(runner, clock, 5, 1)
        clock.now += 24 * 3600
        await _until_ended(runner, batch_id, clock)

    asyncio.run(scenario())
    assert store.get_batch(batch_id, None).status == "expired"
    output, errors = _results(parts, batch_id)
    assert [r["custom_id"] for r in output] == ["a"]
    assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [("b", "batch_expired")]


def test_a_runner_started_again_carries_on_and_never_reruns_a_finished_line(parts):
    store, blobs, clock = parts
    gateway = ScriptedGateway()
    batch_id = _submit(store, blobs, "k1", b"".join(_line(f"r{i}", f"p{i}") for i in range(5)))
    first = _runner(parts, gateway, in_flight=2, per_key=2)

    async def part_way():
        await first.step()
        await asyncio.gather(*list(first._tasks))
        await first.step()  # two lines run and finish
        await asyncio.gather(*list(first._tasks))

    asyncio.run(part_way())
    assert store.get_batch(batch_id, None).counts["completed"] == 2
    # A line that ran but whose runner died before writing its outcome: its first write stands, a second is refused.
    assert store.finish_line(batch_id, 3, {"first": True}, True)
    assert not store.finish_line(batch_id, 3, {"second": True}, True)
    asyncio.run(_until_ended(_runner(parts, gateway), batch_id, clock))
    runs = [line for _, line in gateway.runs]
    assert sorted(runs) == sorted(f"{batch_id}-{n}" for n in (1, 2, 4, 5))
    output, _ = _results(parts, batch_id)
    assert len(output) == 5 and output[2] == {"first": True}


def test_an_input_file_that_cannot_run_fails_the_batch(parts):
    store, blobs, clock = parts
    batch_id = _submit(store, blobs, "k1", b"\xff\xfe not text")
    asyncio.run(_until_ended(_runner(parts, ScriptedGateway()), batch_id, clock))
    batch = store.get_batch(batch_id, None)
    assert batch.status == "failed" and batch.errors[0]["code"] == "invalid_file"
    assert batch.output_file_id is None and batch.error_file_id is None


def test_a_batch_never_validated_expires_at_the_end_of_its_window(parts):
    store, blobs, clock = parts

    class NoGateway(ScriptedGateway):
        async def check(self, owner, url, bodies):
            raise RuntimeError("no gateway deployed")

    batch_id = _submit(store, blobs, "k1", _line("a", "one"))
    runner = _runner(parts, NoGateway())

    async def scenario():
        await _steps(runner, clock, 3, 10)
        assert store.get_batch(batch_id, None).status == "validating"
        clock.now += 24 * 3600
        await _until_ended(runner, batch_id, clock)

    asyncio.run(scenario())
    batch = store.get_batch(batch_id, None)
    assert batch.status == "expired" and batch.output_file_id is None and batch.error_file_id is None
