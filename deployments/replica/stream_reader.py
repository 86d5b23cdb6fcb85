"""A streamed reply as the replica relays it: vLLM's own bytes, never decoded, each beside the tokens the
request had produced in the engine, and one final account at the end (issue 39: relay bytes, not objects).

The gateway writes what it gets to the client and reads nothing in it. What it must know, the replica
says beside the bytes: the running usage (from vLLM's own per-request state, `shunter.engine_usage`, a
dictionary lookup, so a stream cut short is charged the tokens really produced), and in a `StreamEnd` the
final usage and the error event a 200 stream carried, if any.

Only two kinds of event are decoded, once per stream: the final usage chunk of OpenAI's chunk format
(the replica always asks vLLM for it, `include_usage`, and passes it on only when the client asked for
it) and an error event. A typed-event stream (Responses, Messages) ends with its usage in its last event;
only its events that are not token deltas are decoded (a handful per stream). vLLM's running usage on
every chunk (`continuous_usage_stats`) is asked for only when the client asks for it: the replica no
longer has vLLM format a usage object into every chunk for the platform to cut out again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from shunter.endpoints import Endpoint
from shunter.replica_protocol import StreamChunk, StreamEnd
from shunter.wire_formats import WireFormat, cached_prompt_tokens

_ERROR_EVENT = 'data: {"error"'
_OBJECT_EVENT = 'data: {"'  # an event whose data is an object, up to its first key's quote
_NO_CHOICES = ('"choices":[]', '"choices": []')  # vLLM's compact JSON; another engine's spaced one


def chunk_tier(endpoint: Endpoint, body: dict[str, Any]) -> str | None:
    """The `service_tier` the replica writes into each reply and chunk of OpenAI's chunk format (chat,
    completions): the one the gateway put in the body for the request's class. vLLM's models have the
    field on requests only; its Responses objects echo the request's, so nothing is written there."""
    if endpoint.tier_vocabulary != "openai" or endpoint.wire.typed_events:
        return None
    tier = body.get("service_tier")
    return tier if isinstance(tier, str) and tier.isidentifier() else None


def engine_stream_body(body: dict[str, Any], wire: WireFormat) -> tuple[dict[str, Any], bool]:
    """The body the engine runs for a stream in OpenAI's chunk format, with its final usage chunk asked
    for (the platform's account of the stream), and whether the client asked for that chunk itself."""
    if not body.get("stream") or wire.typed_events:
        return body, False
    options = body.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    wanted = bool(options.get("include_usage"))
    if not wanted:
        # vLLM honours continuous_usage_stats only beside include_usage: the client asked for no running
        # usage, and the include_usage added here must not turn it on.
        options.pop("continuous_usage_stats", None)
        options["include_usage"] = True
        body = {**body, "stream_options": options}
    return body, wanted


class StreamReader:
    """One stream's reader; see the module docstring. `counts`: (prompt, completion) tokens the request
    has produced so far (None: an engine that cannot say; the final usage alone then counts)."""

    def __init__(self, wire: WireFormat, counts: Callable[[], tuple[int, int]] | None, usage_chunk_wanted: bool,
                 tier: str | None = None):
        self.wire, self.counts = wire, counts
        self.usage_chunk_wanted = usage_chunk_wanted
        # Each chunk object starts with the tier served, as OpenAI's do (`service_tier` on every chunk).
        self._tier_start = f'data: {{"service_tier":"{tier}","' if tier else None
        self._prompt = self._completion = 0
        self._final: tuple[int, int, int | None] | None = None
        self.error: dict[str, Any] | None = None

    def chunk(self, text: str) -> StreamChunk | None:
        """The chunk for the gateway, or None for one the client did not ask for (the final usage)."""
        if self.wire.typed_events:
            self._typed_event(text)
        elif text.startswith(_ERROR_EVENT):
            error = _event_json(text).get("error")
            self.error = error if isinstance(error, dict) else {"message": str(error)}
        else:
            if _NO_CHOICES[0] in text or _NO_CHOICES[1] in text:
                usage = _event_json(text).get("usage")
                if isinstance(usage, dict):
                    self._final = (_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")),
                                   cached_prompt_tokens(usage))
                    if not self.usage_chunk_wanted:
                        return None
            if self._tier_start is not None:
                text = self._with_tier(text)
        if self.counts is not None:
            self._prompt, self._completion = self.counts()
        return StreamChunk(text, self._prompt, self._completion)

    def _with_tier(self, text: str) -> str:
        """The tier written first into each chunk object (the usage chunk's too, as OpenAI's; never an error
        event or [DONE]). One event per text nearly always; several are told apart by their line starts,
        since JSON has no raw newline inside."""
        start = self._tier_start
        assert start is not None
        if "\ndata: " not in text:
            return start + text[len(_OBJECT_EVENT):] if text.startswith(_OBJECT_EVENT) else text
        return "\n".join(start + line[len(_OBJECT_EVENT):]
                         if line.startswith(_OBJECT_EVENT) and not line.startswith(_ERROR_EVENT) else line
                         for line in text.split("\n"))

    def fault(self, text: str, error: dict[str, Any]) -> StreamChunk:
        """The error event of the request's own fault, found mid-stream (a 4xx: the client's)."""
        self.error = error
        return StreamChunk(text, self._prompt, self._completion)

    def end(self) -> StreamEnd:
        """The stream's account: the final usage the engine reported, else the running count."""
        if self.counts is not None:
            self._prompt, self._completion = self.counts()
        if self._final is None:
            return StreamEnd(self._prompt, self._completion, None, self.error)
        prompt, completion, cached = self._final
        return StreamEnd(max(prompt, self._prompt), max(completion, self._completion), cached, self.error)

    def _typed_event(self, text: str) -> None:
        event = self.wire.read_event(text)  # a token delta (nearly every event) is known by its `event:` line
        if event.error is not None:
            self.error = event.error
        if event.prompt_tokens is not None or event.completion_tokens is not None:
            prompt, completion, cached = self._final or (0, 0, None)
            self._final = (event.prompt_tokens if event.prompt_tokens is not None else prompt,
                           event.completion_tokens if event.completion_tokens is not None else completion, cached)


def _event_json(text: str) -> dict[str, Any]:
    """The JSON object of one SSE `data:` event, or {} when it is not one."""
    try:
        data = json.loads(text[len("data: "):])
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0
