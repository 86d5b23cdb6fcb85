"""A whole reply's tokens so far (shunter.engine_usage): the engine requests its handler submits are noted
in the request's tally, and read from vLLM's output processor as they run; one that finished keeps its
counts. The output processor and the engine's generate are stand-ins with vLLM's shapes."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest

from shunter.engine_protocol import BaseEngine
from shunter.engine_usage import Tally, counting, request_tally

pytestmark = pytest.mark.unit


async def until(condition: Any, timeout_s: float = 10.0) -> None:
    """Let the other tasks run until `condition()` holds (their progress is what the next step needs)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not condition():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.001)


class Detokenizer:
    def __init__(self, tokens: int):
        self.tokens = tokens

    def num_output_tokens(self) -> int:
        return self.tokens


@dataclass
class State:
    prompt_len: int
    detokenizer: Detokenizer | None


@dataclass
class OutputProcessor:
    """vLLM's: engine requests by internal id, and each external id's internal ids (one per choice)."""

    request_states: dict[str, State] = field(default_factory=dict)
    external_req_ids: defaultdict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def add(self, external: str, internal: str, prompt: int, tokens: int | None) -> None:
        self.request_states[internal] = State(prompt, None if tokens is None else Detokenizer(tokens))
        self.external_req_ids[external].append(internal)

    def finish(self, external: str, internal: str) -> None:
        del self.request_states[internal]
        self.external_req_ids[external].remove(internal)


@dataclass
class Choice:
    token_ids: list[int]


@dataclass
class Output:
    prompt_token_ids: list[int]
    outputs: Any
    finished: bool = True


def test_a_request_counts_its_prompt_once_and_every_choice_so_far():
    processor, tally = OutputProcessor(), Tally()
    tally.submit("chat-1")
    assert tally.read(processor) == (0, 0), "not in the engine yet"
    processor.add("chat-1", "0_chat-1-a", prompt=35, tokens=4)  # n=2: two engine requests, one prompt
    processor.add("chat-1", "1_chat-1-a", prompt=35, tokens=6)
    assert tally.read(processor) == (35, 10)
    processor.request_states["1_chat-1-a"].detokenizer.tokens = 9  # type: ignore[union-attr]
    assert tally.read(processor) == (35, 13)


def test_a_choice_that_finished_first_keeps_its_tokens_and_the_final_output_settles_the_request():
    processor, tally = OutputProcessor(), Tally()
    tally.submit("chat-1")
    processor.add("chat-1", "0_chat-1-a", prompt=35, tokens=4)
    processor.add("chat-1", "1_chat-1-a", prompt=35, tokens=6)
    assert tally.read(processor) == (35, 10)
    processor.finish("chat-1", "1_chat-1-a")  # its state leaves vLLM; its tokens stay counted
    processor.request_states["0_chat-1-a"].detokenizer.tokens = 5  # type: ignore[union-attr]
    assert tally.read(processor) == (35, 11)
    processor.finish("chat-1", "0_chat-1-a")
    tally.finished("chat-1", Output(list(range(35)), [Choice([1] * 8), Choice([1] * 6)]))
    assert tally.read(processor) == (35, 14)


def test_a_batch_adds_up_its_prompts_and_an_embedding_has_no_completion():
    processor, tally = OutputProcessor(), Tally()
    for i, prompt in enumerate((4, 2, 7)):
        tally.submit(f"cmpl-{i}")
        processor.add(f"cmpl-{i}", f"cmpl-{i}-a", prompt=prompt, tokens=i)
    assert tally.read(processor) == (13, 3)
    pooled, tally = OutputProcessor(), Tally()
    tally.submit("embd-0")
    pooled.add("embd-0", "embd-0-a", prompt=12, tokens=None)
    assert tally.read(pooled) == (12, 0)
    pooled.finish("embd-0", "embd-0-a")
    tally.finished("embd-0", Output(list(range(12)), object()))  # a pooling output: no token choices
    assert tally.read(pooled) == (12, 0)


class Engine:
    """AsyncLLM's generate: an async generator of outputs, closed (and so aborted) when cancelled."""

    def __init__(self, outputs: list[Output], wait: asyncio.Event | None = None):
        self.outputs, self.wait, self.closed, self.waiting = outputs, wait, 0, 0

    async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any):
        try:
            for output in self.outputs:
                if self.wait is not None:
                    self.waiting += 1  # the request is in the engine, waiting for its output
                    await self.wait.wait()
                yield output
        finally:
            self.closed += 1


def test_generate_notes_its_requests_in_the_running_requests_tally_only():
    engine = Engine([Output([1, 2, 3], [Choice([7, 7])])])
    generate = counting(engine.generate)

    async def run(tally: Tally | None, **kwargs: Any) -> list[Output]:
        token = request_tally.set(tally)
        try:
            return [o async for o in generate("prompt", None, **kwargs)]
        finally:
            request_tally.reset(token)

    tally = Tally()
    assert len(asyncio.run(run(tally, request_id="cmpl-0"))) == 1
    assert tally.submitted == ["cmpl-0"] and tally.final == {"cmpl-0": (3, 2)}
    assert asyncio.run(run(None, request_id="cmpl-1")), "no tally: passed through untouched"
    assert tally.submitted == ["cmpl-0"]

    async def positional() -> None:
        token = request_tally.set(tally)
        try:
            _ = [o async for o in generate("prompt", None, "cmpl-2")]
        finally:
            request_tally.reset(token)

    asyncio.run(positional())
    assert tally.submitted == ["cmpl-0", "cmpl-2"]


def test_a_cancelled_request_closes_the_engines_generator_so_vllm_aborts_it():
    wait = asyncio.Event()
    engine = Engine([Output([1], [Choice([])])], wait)
    generate = counting(engine.generate)

    async def run() -> None:
        tally = Tally()
        token = request_tally.set(tally)

        async def consume() -> None:
            async for _ in generate("prompt", None, "chat-1"):
                pass

        task = asyncio.ensure_future(consume())  # the task copies the context: it sees the tally
        request_tally.reset(token)
        await until(lambda: engine.waiting)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert tally.submitted == ["chat-1"] and tally.final == {}

    asyncio.run(run())
    assert engine.closed == 1


# ---- the replica: its heartbeats carry the counts, and its cancellation cancels the engine's work -------

class CountingEngine(BaseEngine):
    """A fake engine, and only the part of one `ModelServer._serve` calls here (its other members are
    shunter.engine_protocol's BaseEngine defaults): computes a whole chat for a long time, one step every
    10 ms, 2 tokens a step; counts like VLLMEngine."""

    def __init__(self) -> None:
        self.steps, self.aborted = 0, False

    def progress(self) -> int:
        return self.steps

    def produced(self, tally: Tally) -> tuple[int, int]:
        return (35, 2 * self.steps) if tally.submitted else (0, 0)

    async def chat(self, body: dict[str, Any]) -> Any:
        tally = request_tally.get()
        assert tally is not None, "a whole reply runs with a tally"
        tally.submit("chatcmpl-1")  # what `counting` does when vLLM's handler calls generate
        try:
            while True:
                await asyncio.sleep(0.01)
                self.steps += 1
        except asyncio.CancelledError:
            self.aborted = True  # vLLM's generate aborts the engine request here
            raise


def test_a_whole_replys_heartbeats_carry_its_tokens_and_closing_the_call_aborts_the_work(monkeypatch):
    from types import SimpleNamespace

    from shunter.deployments.replica import model_server
    from shunter.replica_protocol import Accepted, ReplicaRequest, Working

    monkeypatch.setattr(model_server, "_PROGRESS_S", 0.05)
    server = object.__new__(model_server.ModelServer)  # no engine start: what `_serve` reads
    server.model, server.replica_id, server._heartbeat_s = SimpleNamespace(name="m"), "r1", 10.0
    server._channel = SimpleNamespace(address=None, close=lambda: None)
    server.engine = engine = CountingEngine()

    async def run() -> list[Any]:
        items, replies = [], server._serve(ReplicaRequest(endpoint="chat", body={"model": "m", "messages": []}))
        async for item in replies:
            items.append(item)
            if len(items) == 4:
                break
        await replies.aclose()  # the gateway cancelled the call: its client left
        await until(lambda: engine.aborted)
        return items

    items = asyncio.run(run())
    assert isinstance(items[0], Accepted) and all(isinstance(i, Working) for i in items[1:]), items
    counts = [(i.prompt_tokens, i.completion_tokens) for i in items[1:]]
    assert all(p == 35 for p, _ in counts) and counts[0][1] > 0 and counts == sorted(counts), counts
    assert engine.aborted, "the work was cancelled"
