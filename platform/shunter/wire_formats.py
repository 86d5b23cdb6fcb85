"""What differs between the APIs the platform serves, on the wire: error envelopes and stream events.

Chat and completions stream OpenAI's `data: {...}` chunks and end with `data: [DONE]`; the Responses API
streams typed events (`event: response.output_text.delta`, ... `event: response.completed` carrying the
usage); Anthropic's Messages API streams its own typed events (`message_start` with the prompt tokens,
`content_block_delta`, `message_delta` with the completion tokens) and answers errors as
`{"type": "error", "error": {"type": ..., "message": ...}}`. Everything else about a request (the door,
routing, versions, quotas) is the same for all of them; this module is the one place that knows the
shapes, one `WireFormat` per shape, named by each API's descriptor (`shunter.endpoints`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shunter.errors import error_body

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                          500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(body: Any, status: int) -> dict[str, Any]:
    """An OpenAI-shaped error body (every refusal the gateway or the engine makes) in Anthropic's shape."""
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    kind = _ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(message or f"HTTP {status}")}}


@dataclass(frozen=True)
class StreamEvent:
    """What the platform reads from one typed event: a token delta, the usage it carries (either field
    None when absent), or an error (its OpenAI-style `error` object: message, and code when known)."""

    token: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: dict[str, Any] | None = None


_NOTHING = StreamEvent()
_TOKEN = StreamEvent(token=True)
# Anthropic counts cached prompt tokens apart from `input_tokens`; the engine computed them all the same.
_CACHED_PROMPT = ("cache_read_input_tokens", "cache_creation_input_tokens")


class WireFormat:
    """OpenAI's wire: `data: {...}` chunks ending with `data: [DONE]`, and `{"error": {...}}` errors. A
    stream's usage is counted by the replica beside its chunks (shunter.deployments.replica.stream_reader);
    the gateway writes the chunks as they are."""

    typed_events = False  # streams typed `event:` lines (read by `read_event`) rather than chunks

    def error_body(self, body: dict[str, Any], status: int) -> dict[str, Any]:
        """An OpenAI-shaped error body in this API's envelope."""
        return body

    def error_event(self, message: str, status: int, code: str) -> str:
        """The event that ends a started stream with an error."""
        return f"data: {json.dumps(error_body(message, status, code=code))}\n\n"

    def read_event(self, text: str) -> StreamEvent:
        """What the platform reads from one typed event (typed-event formats only)."""
        raise NotImplementedError


class _TypedEvents(WireFormat):
    """SSE typed events (`event: <type>\ndata: {...}\n\n`): their streams end with the usage, and have no
    option to ask for it on every chunk. A token delta, nearly every event of a stream, is known by its
    `event:` line alone; only the few others (usage, errors) are decoded."""

    typed_events = True

    def _is_delta(self, kind: str) -> bool:
        raise NotImplementedError

    def _read(self, kind: str, data: dict[str, Any]) -> StreamEvent:
        raise NotImplementedError

    def read_event(self, text: str) -> StreamEvent:
        if text.startswith("event: "):
            if self._is_delta(text[len("event: "):text.find("\n")]):
                return _TOKEN
        start = text.find("data: ")
        if start < 0:
            return _NOTHING
        try:
            data = json.loads(text[start + len("data: "):])
        except ValueError:
            return _NOTHING
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            return _NOTHING
        kind = data["type"]
        if self._is_delta(kind):  # an event without an `event:` line
            return _TOKEN
        return self._read(kind, data)


class _ResponsesEvents(_TypedEvents):
    """OpenAI's Responses API: `response.output_text.delta` ... `response.completed` with the usage."""

    def error_event(self, message: str, status: int, code: str) -> str:
        data = {"type": "error", "code": code, "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(data)}\n\n"

    def _is_delta(self, kind: str) -> bool:  # text, reasoning and tool-argument deltas
        return kind.endswith(".delta")

    def _read(self, kind: str, data: dict[str, Any]) -> StreamEvent:
        if kind == "error":
            code = data.get("code")
            return StreamEvent(error={"message": data.get("message"), "code": code if code is not None else 500})
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            response = data.get("response")
            return _usage(response.get("usage") if isinstance(response, dict) else None)
        return _NOTHING


class _AnthropicEvents(_TypedEvents):
    """Anthropic's Messages API: `message_start` with the prompt tokens, `content_block_delta`s,
    `message_delta` with the completion tokens; errors as `{"type": "error", "error": {"type", "message"}}`."""

    def error_body(self, body: dict[str, Any], status: int) -> dict[str, Any]:
        return anthropic_error(body, status)

    def error_event(self, message: str, status: int, code: str) -> str:
        return f"event: error\ndata: {json.dumps(anthropic_error(error_body(message, status), status))}\n\n"

    def _is_delta(self, kind: str) -> bool:
        return kind == "content_block_delta"

    def _read(self, kind: str, data: dict[str, Any]) -> StreamEvent:
        if kind == "error":  # Anthropic's errors carry a type, no code
            error = data.get("error")
            error = error if isinstance(error, dict) else {}
            kind = error.get("type")
            return StreamEvent(error={"message": error.get("message"), "type": kind,
                                      "code": 400 if kind == "invalid_request_error" else 500})
        if kind == "message_start":  # the prompt; output_tokens is 0 here
            message = data.get("message")
            return _usage(message.get("usage") if isinstance(message, dict) else None, completion=False)
        if kind == "message_delta":
            return _usage(data.get("usage"))
        return _NOTHING


OPENAI_CHUNKS = WireFormat()
RESPONSES_EVENTS = _ResponsesEvents()
ANTHROPIC_EVENTS = _AnthropicEvents()


def cached_prompt_tokens(usage: Any) -> int | None:
    """The prompt tokens the engine found in its prefix cache, where a usage says (vLLM with
    `enable_prompt_tokens_details`: `prompt_tokens_details.cached_tokens`; Responses: `input_tokens_details`)."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return _count(details.get("cached_tokens")) if isinstance(details, dict) else None


def whole_usage(body: Any) -> tuple[int, int] | None:
    """(prompt, completion) tokens of a whole reply in any of the APIs' shapes, or None without usage."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    return _prompt_tokens(usage) or 0, _count(usage.get("output_tokens")) or 0


def _usage(usage: Any, completion: bool = True) -> StreamEvent:
    """A typed event's `usage` (Responses' and Anthropic's names); `completion`: it counts the output."""
    if not isinstance(usage, dict):
        return _NOTHING
    return StreamEvent(prompt_tokens=_prompt_tokens(usage),
                       completion_tokens=_count(usage.get("output_tokens")) if completion else None)


def _prompt_tokens(usage: dict[str, Any]) -> int | None:
    prompt = _count(usage.get("input_tokens"))
    return None if prompt is None else prompt + sum(_count(usage.get(k)) or 0 for k in _CACHED_PROMPT)


def _count(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
