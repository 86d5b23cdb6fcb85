"""What a whole (not streamed) reply has produced in the engine so far, while vLLM still computes it.

A stream carries its running usage on every chunk, so the gateway always knows what a stream cut short
produced. A whole reply says nothing until it is done: vLLM's handlers ask the engine for the final
output only. When its client leaves, the gateway cancels the request and the engine aborts it, and the
caller's key must be charged what the engine had produced by then: never nothing, never the whole
reservation for work not done. Only the replica can see that, so it counts:

- `counting` wraps AsyncLLM.generate and .encode (as shunter.kv_events wraps generate): a request run
  with a `Tally` in `request_tally` (a context variable the request's task copies when it is created, so
  every engine request its handler submits sees it, a batch's too) has the engine request ids noted
  there, and the counts of each one's final output once it finishes;
- `Tally.read(output_processor)` adds up, for the ids not finished, vLLM's own per-request state: the
  prompt's length and the tokens its detokenizer has taken so far, whatever the request's output kind
  (private to vLLM: read by `shunter.vllm_compat.request_progress`).
  A dictionary lookup per engine request, so a replica can read it with every heartbeat.

The replica sends these counts with its `Working` heartbeats (shunter.replica_protocol); the gateway keeps
the latest and a request whose client left is settled at them (shunter.deployments.gateway.request_end).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from shunter import vllm_compat


@dataclass
class Tally:
    """One replica request's engine requests (vLLM's external ids, one per prompt of a batch or input of
    an embedding) and the tokens each has produced so far, as last read."""

    submitted: list[str] = field(default_factory=list)
    final: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (prompt, completion) when done
    _prompt: dict[str, int] = field(default_factory=dict)  # id -> its prompt's tokens, once seen
    _output: dict[str, dict[str, int]] = field(default_factory=dict)  # id -> its engine requests' outputs

    def submit(self, request_id: str) -> None:
        self.submitted.append(request_id)

    def finished(self, request_id: str, output: Any) -> None:
        """The engine's final output for `request_id` (a RequestOutput, or a pooling one: no completion)."""
        prompt = len(getattr(output, "prompt_token_ids", None) or ())
        choices = getattr(output, "outputs", None)
        completion = sum(len(getattr(c, "token_ids", None) or ()) for c in choices) \
            if isinstance(choices, list) else 0
        seen = self._output.get(request_id, {})
        self.final[request_id] = (max(prompt, self._prompt.get(request_id, 0)), max(completion, sum(seen.values())))

    def read(self, output_processor: Any) -> tuple[int, int]:
        """(prompt tokens, completion tokens) produced so far, from vLLM's output processor (its
        per-request state, read by `shunter.vllm_compat.request_progress`). An engine request that
        finished keeps its last counts (a choice of `n` may finish before the others)."""
        prompt = completion = 0
        for request_id in self.submitted:
            done = self.final.get(request_id)
            if done is None:
                outputs = self._output.setdefault(request_id, {})
                progress = vllm_compat.request_progress(output_processor, request_id)
                for engine_id, prompt_tokens, output_tokens in progress:
                    self._prompt[request_id] = prompt_tokens
                    if output_tokens is not None:
                        outputs[engine_id] = output_tokens
                done = (self._prompt.get(request_id, 0), sum(outputs.values()))
            prompt += done[0]
            completion += done[1]
        return prompt, completion


# The tally of the request being run, set by the replica around creating the request's task.
request_tally: ContextVar[Tally | None] = ContextVar("shunter_request_tally", default=None)


def counting(call: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """AsyncLLM.generate or .encode (`prompt, params, request_id, ...`), noting each request in the
    running request's `request_tally`, if it has one."""

    def counted(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        tally = request_tally.get()
        stream = call(*args, **kwargs)
        request_id = kwargs.get("request_id", args[2] if len(args) > 2 else None)
        if tally is None or not isinstance(request_id, str):
            return stream
        tally.submit(request_id)
        return _noting_the_end(stream, tally, request_id)

    return counted


async def _noting_the_end(stream: AsyncIterator[Any], tally: Tally, request_id: str) -> AsyncIterator[Any]:
    try:
        async for output in stream:
            if getattr(output, "finished", False):
                tally.finished(request_id, output)
            yield output
    finally:
        # Closed early (the request was cancelled): vLLM aborts the engine request when its own closes.
        await stream.aclose()  # type: ignore[attr-defined]
