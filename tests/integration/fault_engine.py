"""FAKE ENGINE for platform fault tests only. Real behaviour is tested against vLLM in tests/e2e.

The real engine cannot be made, on demand, to fail, hang or die in the middle of a stream, so these
tests swap it (through ModelServer's `engine_factory` seam) for this fake, which implements the engine
interface the replica calls (shunter.engine_protocol.ServingEngine, through its BaseEngine: no counters,
LoRA or prefix view; a stream's running token counts, as `produced`) and answers with EngineReply as shunter.engine.VLLMEngine does. It
serves chat and completions (embeddings: one zero vector); the Responses and Messages APIs raise. What it
does depends on the model's `source`:

- `fake:flaky`: echoes the last message word by word (as an SSE chat stream when asked to stream). A
  message containing "DIE" makes the replica process exit after three chunks (a crash mid-stream); one
  containing "BAD" gets a 400 (a client error, which must never count against the replica); one containing
  "INBAND" streams three words, then ends as vLLM ends a stream whose engine core died: an error event
  with code 500 inside the 200 stream, then `[DONE]`.
  A word `pace=<seconds>` in the message sets the delay between words (default 0.05 s), for long
  streams; with it, a non-streamed reply takes as long as its stream would (else it is instant).
- `fake:never-starts`: raises during start-up, every time.
- `fake:broken`: starts, then answers every request with a 500 (a bad new version).
- `fake:slow`: like `fake:flaky`, but waits `SLOW_S` before answering and streams ten times slower (a
  new version far slower than the old).
- any other source: the real vLLM engine (so a test can run a real old version beside a fake new one).

Per-replica faults, switched by the test while the app runs: when the environment names a control
directory (`SHUNTER_FAULT_DIR`), the file `<dir>/<replica id>` holds this replica's mode: `ok`, `error`
(the engine raises), `fail500` (the engine answers 500) or `hang` (the engine never answers). Each
request a replica receives appends a line to `<dir>/<replica id>.calls`, so tests can count attempts.
A file `<dir>/start-delay` holding seconds makes every replica that starts from then on take that long.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from shunter.engine import EngineReply, EngineSpec
from shunter.engine_protocol import BaseEngine
from shunter.engine_usage import Tally, request_tally
from shunter.errors import error_body

SLOW_S = 1.0


class FaultInjectingEngine(BaseEngine):
    """FAKE ENGINE, for fault injection only (see the module docstring)."""

    def __init__(self, spec: EngineSpec, replica: str):
        self.spec = spec
        self.replica = replica
        self.unfinished = 0
        self.steps = 0  # progress(): grows while this engine works; a hung one stays put
        control = os.environ.get("SHUNTER_FAULT_DIR")
        self.control = Path(control) if control else None

    @classmethod
    async def start(cls, spec: EngineSpec, env: dict[str, str] | None = None) -> Any:
        if not spec.model_path.startswith("fake:"):
            from shunter.engine import VLLMEngine

            return await VLLMEngine.start(spec, env)
        if spec.model_path == "fake:never-starts":
            raise RuntimeError("fault injection: this engine never starts")
        from ray import serve

        control = os.environ.get("SHUNTER_FAULT_DIR")
        delay = Path(control, "start-delay") if control else None
        if delay is not None and delay.exists():
            await asyncio.sleep(float(delay.read_text().strip() or 0))
        return cls(spec, serve.get_replica_context().replica_id.unique_id)

    def _mode(self) -> str:
        if self.spec.model_path == "fake:broken":
            return "fail500"
        if self.control is None:
            return "ok"
        try:
            return (self.control / self.replica).read_text().strip() or "ok"
        except FileNotFoundError:
            return "ok"

    def _count(self, text: str) -> None:
        if self.control is not None:
            with open(self.control / f"{self.replica}.calls", "a") as f:
                f.write(text.replace("\n", " ")[:80] + "\n")

    async def chat(self, body: dict[str, Any]) -> EngineReply:
        text = str(body["messages"][-1]["content"])
        self._count(text)
        if "BAD" in text:
            return EngineReply(400, error_body("fault injection: a client error", 400, param="messages"))
        mode = self._mode()
        if mode == "error":
            raise RuntimeError("fault injection: the engine failed")
        if mode == "fail500":
            return EngineReply(500, error_body("fault injection: internal engine error", 500))
        if mode == "hang":
            await asyncio.sleep(3600)
        slow = self.spec.model_path == "fake:slow"
        if slow:
            await asyncio.sleep(SLOW_S)
        if not body.get("stream"):
            if (pace := _pace(text)) is not None:
                for _ in text.split():  # one "step" per word, as an engine steps per token
                    await asyncio.sleep(pace)
                    self.steps += 1
            return EngineReply(200, {"object": "chat.completion", "model": self.spec.served_name,
                                     "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                  "finish_reason": "stop"}]})
        options = body.get("stream_options") or {}
        # The request's tally, read here as vLLM's generate reads it when the handler calls it (the stream
        # itself is read later, outside the request's task).
        return EngineReply(200, stream=self._stream(text, request_tally.get(), 10 if slow else 1,
                                                    bool(options.get("include_usage")),
                                                    bool(options.get("continuous_usage_stats"))))

    def produced(self, tally: Tally) -> tuple[int, int]:
        """A stream's tokens so far, as the real engine's output processor says them."""
        return tally.read(None)

    async def _stream(self, text: str, tally: Tally | None, slower: float = 1, final_usage: bool = False,
                      usage: bool = False) -> AsyncIterator[str]:
        """One word per chunk (a prompt token per word of the last message, a completion token per word
        sent), counted where the replica reads them (`produced`), on each chunk with `usage` (vLLM's
        `continuous_usage_stats`) and in a last usage chunk with `final_usage` (`include_usage`)."""
        prompt, words = len(text.split()), 0
        engine_id = f"fake-{os.urandom(8).hex()}"
        if tally is not None:
            tally.submit(engine_id)
            tally.final[engine_id] = (prompt, 0)
        self.unfinished += 1  # like an engine's running requests: the autoscaler's signal
        try:
            for i, word in enumerate(text.split()):
                if i == 3 and "DIE" in text:
                    os._exit(1)  # the replica process dies mid-stream
                if i == 3 and "INBAND" in text:
                    error = error_body("fault injection: EngineCore encountered an issue", 500)
                    yield f"data: {json.dumps(error)}\n\n"
                    break
                chunk: dict[str, Any] = {
                    "object": "chat.completion.chunk", "model": self.spec.served_name,
                    "choices": [{"index": 0, "delta": {"content": word + " "}, "finish_reason": None}]}
                if usage:
                    chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": i + 1,
                                      "total_tokens": prompt + i + 1}
                words = i + 1
                if tally is not None:
                    tally.final[engine_id] = (prompt, words)
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep((_pace(text) or 0.05) * slower)
            if final_usage:
                yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': prompt, 'completion_tokens': words}})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.unfinished -= 1

    async def completion(self, body: dict[str, Any]) -> EngineReply:
        return await self.chat({**body, "messages": [{"content": body.get("prompt", "")}]})

    async def embedding(self, body: dict[str, Any]) -> EngineReply:
        return EngineReply(200, {"object": "list", "data": [{"index": 0, "embedding": [0.0]}]})

    async def responses(self, body: dict[str, Any]) -> EngineReply:
        raise NotImplementedError("fault injection: the fake engine does not serve the Responses API")

    async def messages(self, body: dict[str, Any]) -> EngineReply:
        raise NotImplementedError("fault injection: the fake engine does not serve the Messages API")

    async def warmup(self) -> None:
        return None

    async def check_health(self) -> None:
        return None

    def progress(self) -> int:
        return self.steps

    def num_unfinished_requests(self) -> int:
        return self.unfinished

    def max_model_len(self) -> int:
        return 2048

    async def prompt_lengths(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        return None  # no tokenizer: prompt-token limits are the real engine's (tests/e2e)

    def kv_cache_blocks(self) -> int:
        return 64

    def block_size(self) -> int:
        return 16

    def shutdown(self) -> None:
        return None


def _pace(text: str) -> float | None:
    for word in text.split():
        if word.startswith("pace="):
            return float(word[len("pace="):])
    return None
