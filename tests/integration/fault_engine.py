"""FAKE ENGINE for platform fault tests only. Real behaviour is tested against vLLM in tests/e2e.

The real engine cannot be made, on demand, to die in the middle of a stream or to never start, so
these tests swap it (through ModelServer's `engine_factory` seam) for this stand-in, which speaks the
same EngineReply protocol as shunter.engine.VLLMEngine. What it does depends on the model's `source`:

- `fake:flaky`: echoes the last message word by word as an SSE chat stream; if the message contains
  "DIE", the replica process exits after three chunks (a crash mid-stream).
- `fake:never-starts`: raises during start-up, every time.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from typing import Any

from shunter.engine import EngineReply, EngineSpec


class FaultInjectingEngine:
    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.unfinished = 0

    @classmethod
    async def start(cls, spec: EngineSpec, env: dict[str, str] | None = None) -> FaultInjectingEngine:
        if spec.model_path == "fake:never-starts":
            raise RuntimeError("fault injection: this engine never starts")
        return cls(spec)

    async def chat(self, body: dict[str, Any]) -> EngineReply:
        text = str(body["messages"][-1]["content"])
        if not body.get("stream"):
            return EngineReply(200, {"object": "chat.completion", "model": self.spec.served_name,
                                     "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                  "finish_reason": "stop"}]})
        return EngineReply(200, stream=self._stream(text))

    async def _stream(self, text: str) -> AsyncIterator[str]:
        for i, word in enumerate(text.split()):
            if i == 3 and "DIE" in text:
                os._exit(1)  # the replica process dies mid-stream
            chunk = {"object": "chat.completion.chunk", "model": self.spec.served_name,
                     "choices": [{"index": 0, "delta": {"content": word + " "}, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(0.05)
        yield "data: [DONE]\n\n"

    async def completion(self, body: dict[str, Any]) -> EngineReply:
        return await self.chat({**body, "messages": [{"content": body.get("prompt", "")}]})

    async def embedding(self, body: dict[str, Any]) -> EngineReply:
        return EngineReply(200, {"object": "list", "data": [{"index": 0, "embedding": [0.0]}]})

    async def warmup(self) -> None:
        return None

    async def check_health(self) -> None:
        return None

    def num_unfinished_requests(self) -> int:
        return self.unfinished

    def max_model_len(self) -> int:
        return 2048

    def shutdown(self) -> None:
        return None
