"""What the gateway keeps of a stream it relays without reading it (issue 39: relay bytes, not objects).

The replica sends each chunk's bytes with the tokens the request had produced in the engine beside them,
and ends the stream with its account (`shunter.replica_protocol.StreamChunk`, `StreamEnd`;
shunter.deployments.replica.stream_reader). The gateway writes the bytes to the client as they are; this
keeps the request's `Usage` at the running count (so a stream cut short is settled at the tokens it
produced), tells the telemetry when a chunk brought new tokens (TTFT, inter-token gaps), and holds the
error event a 200 stream carried, for the request's outcome.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from shunter.deployments.gateway.context import Usage
from shunter.replica_protocol import StreamChunk, StreamEnd


class StreamAccount:
    """One stream's account; see the module docstring."""

    def __init__(self, usage: Usage, on_token: Callable[[float], None]):
        self.usage, self.on_token = usage, on_token
        self.in_band_error: dict[str, Any] | None = None  # an error event inside a 200 stream
        self.ended = False  # its StreamEnd arrived

    def chunk(self, item: StreamChunk) -> str:
        """A chunk's bytes for the client; its running usage noted, and its arrival timed when it brought
        tokens (a stream's first events may carry none: a Responses stream's `response.created`)."""
        usage = self.usage
        if item.completion_tokens > usage.completion_tokens:
            usage.completion_tokens = item.completion_tokens
            self.on_token(time.monotonic())
        if item.prompt_tokens > usage.prompt_tokens:
            usage.prompt_tokens = item.prompt_tokens
        return item.text

    def end(self, item: StreamEnd) -> None:
        """The stream's final usage, as the engine counted it, and its in-band error."""
        self.ended = True
        usage = self.usage
        if item.completion_tokens > usage.completion_tokens and not usage.completion_tokens:
            self.on_token(time.monotonic())  # tokens that came with no chunk of their own still had a first
        usage.prompt_tokens, usage.completion_tokens = item.prompt_tokens, item.completion_tokens
        usage.cached_tokens = item.cached_tokens
        self.in_band_error = item.error

    def take(self, item: Any) -> str | None:
        """An item off the replica's stream: a chunk's bytes, or None (its end, noted)."""
        if isinstance(item, StreamChunk):
            return self.chunk(item)
        if isinstance(item, StreamEnd):
            self.end(item)
            return None
        raise RuntimeError(f"replica protocol: {type(item).__name__} in a stream")
