"""The client's stream, filtered: what the platform reads from each chunk, and what it takes back out.

The platform asks the engine for its running usage on every chunk of an OpenAI-format stream
(`context.engine_body`), so a stream cut short is settled at the tokens it produced. The client asked for
less: usage on every chunk only with `stream_options.continuous_usage_stats`, the final usage chunk only
with `include_usage`. `StreamFilter.chunk` reads each chunk's usage into the request's `Usage`, notes an
error event inside a 200 stream (vLLM reports an engine failure mid-stream in-band, then [DONE]), tells
the telemetry when a token chunk passes (TTFT, inter-token gaps), and returns the chunk as the client asked
for it, or None to drop it.

vLLM's chunks are compact JSON with `usage` as their last key; those are read without decoding the event
(the usage object alone is parsed and cut off the text, so the client gets vLLM's own bytes). Any other
event (an error, another engine's layout) is decoded whole. The typed events of the Responses and Messages
APIs pass unchanged: their deltas are counted one token each until the final usage arrives.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from shunter.deployments.gateway.context import Usage
from shunter.endpoints import ParsedRequest
from shunter.wire_formats import cached_prompt_tokens


class StreamFilter:
    """One stream's filter; see the module docstring."""

    def __init__(self, parsed: ParsedRequest, usage: Usage, on_token: Callable[[float], None]):
        self.wire = parsed.endpoint.wire
        self.usage, self.on_token = usage, on_token
        self.wants_usage, self.wants_continuous = parsed.usage_chunk, parsed.continuous_usage
        self.choices_per_prompt = max(1, parsed.n)  # a completions batch numbers its choices prompt by prompt
        # Running usage: per choice index, the completion tokens so far; per prompt, its prompt tokens.
        self._completion_by_choice: dict[int, int] = {}
        self._prompt_by_prompt: dict[int, int] = {}
        self.in_band_error: dict[str, Any] | None = None  # an error event inside a 200 stream
        self._final_usage = False  # a typed-event stream's usage event has arrived

    def chunk(self, text: str) -> str | None:
        if self.wire.typed_events:
            return self._typed_event(text)
        if not text.startswith("data: {"):
            return text
        split = _split_usage(text)
        if split is None:
            return self._decoded_chunk(text)
        event, usage = split
        index = _first_choice_index(event)
        if index is None:
            if '"choices":[]' not in event:
                return self._decoded_chunk(text)
            self._totals(usage)  # the final usage-only chunk
            return text if self.wants_usage else None
        self._running_usage(index, usage)
        self.on_token(time.monotonic())
        return text if self.wants_continuous else event

    def _decoded_chunk(self, text: str) -> str | None:
        data = _event_json(text)
        choices = data.get("choices")
        if not choices and isinstance(data.get("error"), dict):
            self.in_band_error = data["error"]
            return text
        usage = data.get("usage")
        if isinstance(usage, dict):
            if not choices:  # the final usage-only chunk
                self._totals(usage)
                return text if self.wants_usage else None
            first = choices[0] if isinstance(choices[0], dict) else {}
            index = first.get("index", 0)
            if isinstance(index, int):
                self._running_usage(index, usage)
            if not self.wants_continuous:
                del data["usage"]
                text = f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"
        if choices:
            self.on_token(time.monotonic())
        return text

    def _typed_event(self, text: str) -> str:
        event = self.wire.read_event(text)
        usage = self.usage
        if event.token:
            self.on_token(time.monotonic())
            if not self._final_usage:
                usage.completion_tokens += 1
        if event.prompt_tokens is not None:
            usage.prompt_tokens = event.prompt_tokens
        if event.completion_tokens is not None:
            usage.completion_tokens = event.completion_tokens
            self._final_usage = True
        if event.error is not None:
            self.in_band_error = event.error
        return text

    def _totals(self, usage: dict[str, Any]) -> None:
        self.usage.cached_tokens = cached_prompt_tokens(usage)
        self.usage.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.usage.completion_tokens = int(usage.get("completion_tokens") or 0)

    def _running_usage(self, index: int, usage: dict[str, Any]) -> None:
        """One chunk's running usage (vLLM's `continuous_usage_stats`: the chunk's choice's completion
        tokens so far and its prompt's tokens)."""
        self._completion_by_choice[index] = int(usage.get("completion_tokens") or 0)
        self._prompt_by_prompt[index // self.choices_per_prompt] = int(usage.get("prompt_tokens") or 0)
        self.usage.completion_tokens = sum(self._completion_by_choice.values())
        self.usage.prompt_tokens = sum(self._prompt_by_prompt.values())


def _event_json(text: str) -> dict[str, Any]:
    """The JSON object of one SSE `data:` event, or {} when it is not one."""
    try:
        data = json.loads(text[len("data: "):])
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


_USAGE_KEY = ',"usage":'
_FIRST_CHOICE = '"choices":[{"index":'


def _split_usage(text: str) -> tuple[str, dict[str, Any]] | None:
    """A compact `data: {..., "usage": {...}}` event as (the event without its usage key, the usage), or
    None when the event does not end with a usage object. A quote inside a JSON string is escaped, so the
    last `,"usage":` of the text is the key itself."""
    cut = text.rfind(_USAGE_KEY)
    if cut < 0 or not text.endswith("}}\n\n"):
        return None
    try:
        usage = json.loads(text[cut + len(_USAGE_KEY):-3])
    except ValueError:  # `usage` was not the last key
        return None
    if not isinstance(usage, dict):
        return None
    return text[:cut] + "}\n\n", usage


def _first_choice_index(event: str) -> int | None:
    """The index of a compact event's first choice, or None when it has no choice in that layout."""
    start = event.find(_FIRST_CHOICE)
    if start < 0:
        return None
    start += len(_FIRST_CHOICE)
    end = start
    while end < len(event) and event[end].isdigit():
        end += 1
    return int(event[start:end]) if end > start else None
