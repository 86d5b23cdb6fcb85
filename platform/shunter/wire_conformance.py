"""Where vLLM's Responses and Messages layers differ from the official APIs in ways the official SDKs
notice, the replica's replies are brought in line here: pure functions over reply dicts and SSE text.

vLLM (0.32) reuses its serving layer's shapes, and two of them are not what OpenAI and Anthropic send:

- A Responses stream cut short (by `max_output_tokens`) ends with `event: response.completed` whose
  response has `status: "incomplete"`. OpenAI ends such a stream with `response.incomplete` (the same
  response object; `incomplete_details.reason` says why); clients that dispatch on the event type (the
  OpenAI SDK's stream helpers, agent frameworks) never see their "incomplete" branch otherwise. Only that
  last event is decoded and rewritten; every other chunk passes as vLLM wrote it, told apart by its
  `event:` line alone.
- A whole Messages reply is dumped without its null fields (the content blocks share one model whose
  unused fields must not appear), which also drops the fields Anthropic's Message always carries:
  `stop_sequence` (null unless a stop sequence matched), `stop_reason`, and usage's
  `cache_creation_input_tokens` / `cache_read_input_tokens` (null or a count). They are put back.

vLLM's streamed Messages events already match Anthropic's documented format (`message_start`'s message
carries `stop_reason: null` and `stop_sequence: null`; `message_delta`'s delta carries both), so
they pass untouched. A whole Responses reply cut short already has `status: "incomplete"` and
`incomplete_details: {"reason": "max_output_tokens"}`, as OpenAI's does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

_COMPLETED = "response.completed"
_INCOMPLETE = "response.incomplete"
_COMPLETED_LINE = f"event: {_COMPLETED}\n"

# The keys an Anthropic Message always carries, null when there is nothing to say (the API reference,
# and `anthropic.types.Message` / `Usage`).
_MESSAGE_NULLABLE = ("stop_reason", "stop_sequence")
_USAGE_NULLABLE = ("cache_creation_input_tokens", "cache_read_input_tokens")


def incomplete_responses_event(chunk: str) -> str:
    """One SSE event of a Responses stream, as OpenAI sends it: a `response.completed` whose response is
    `incomplete` becomes `response.incomplete` (its data otherwise unchanged). Any other chunk comes back
    as it is."""
    if not chunk.startswith(_COMPLETED_LINE):
        return chunk
    start = chunk.find("data: ")
    try:
        data = json.loads(chunk[start + len("data: "):]) if start >= 0 else None
    except ValueError:
        return chunk
    response = data.get("response") if isinstance(data, dict) else None
    if not isinstance(response, dict) or response.get("status") != "incomplete":
        return chunk
    data["type"] = _INCOMPLETE
    return f"event: {_INCOMPLETE}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def openai_responses_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A Responses stream's SSE text whose ending is OpenAI's (see `incomplete_responses_event`). Each
    chunk is one event; only the one starting with `event: response.completed` is decoded. Anything that
    is not text (a replica's own end-of-stream item) passes through."""
    async for chunk in chunks:
        if isinstance(chunk, str) and chunk.startswith(_COMPLETED_LINE):
            chunk = incomplete_responses_event(chunk)
        yield chunk


def anthropic_message(body: dict[str, Any]) -> dict[str, Any]:
    """A whole Messages reply (vLLM's, dumped without nulls) with the keys Anthropic's Message always
    carries: `stop_reason`, `stop_sequence`, and usage's cache counts, null where vLLM had none. Changed
    in place and returned; an error body (no `"type": "message"`) is left alone."""
    if body.get("type") != "message":
        return body
    for key in _MESSAGE_NULLABLE:
        body.setdefault(key, None)
    usage = body.get("usage")
    if isinstance(usage, dict):
        for key in _USAGE_NULLABLE:
            usage.setdefault(key, None)
    return body
