"""The stream relay: the replica's chunks to the client, as bytes, and how a started stream ends.

The chunks are written as the replica sent them, never parsed (their usage comes beside them:
shunter.deployments.gateway.stream_account); those already waiting in a stream's inbox when the client's
connection is free go out in one write.

Once the first byte has gone to the client there is no failing over: a replica that breaks or goes
silent mid-stream, a stream still running when its leaving replica's drain timeout is up, and a stream
past the request's deadline or idle limit all end with an explicit error event in the API's own shape
(the endpoint's `shunter.wire_formats.WireFormat`). A client that goes away cancels the replica's work.
However it ends, the relay settles the request's `RequestEnd` once, with the stream's typed `Outcome`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from shunter.config import LimitsConfig
from shunter.deployments.gateway.context import CLIENT_GONE, STREAM_ERROR, Ending, Outcome
from shunter.deployments.gateway.replica_call import Started
from shunter.deployments.gateway.replica_stream import (
    DrainTimeout,
    RequestDeadline,
    StreamIdle,
    next_chunk,
    next_item,
)
from shunter.deployments.gateway.request_end import RequestEnd
from shunter.deployments.gateway.stream_account import StreamAccount
from shunter.engine import REQUEST_FAULT_CODE
from shunter.replica_protocol import Moved, StreamChunk

log = logging.getLogger("ray.serve")


async def relay(started: Started, end: RequestEnd, account: StreamAccount, first: str | None,
                limits: LimitsConfig) -> AsyncIterator[str]:
    """The client's stream, from its first chunk's bytes (`first`, already taken into `account`); see the
    module docstring. Settles the request once, with the stream's outcome."""
    ctx = end.ctx
    model, wire = ctx.model, ctx.endpoint.wire
    stream, replica, timeout = started.stream, started.replica, model.routing.replica_timeout_s
    routing = end.reply.routing if end.reply is not None else None
    deadline = ctx.began + limits.request_timeout_s
    inbox, ray_end = None, None  # once the stream moved to the token channel: its inbox, and the Ray call
    # The client left (the generator closed at a yield) unless the stream reached one of the endings below.
    outcome = Outcome(Ending.CLIENT_GONE, CLIENT_GONE, finished=False)
    try:
        if first is not None:
            yield first
        held = None  # an item read while gathering the waiting chunks, not yet handled
        while not account.ended:
            if held is not None:
                item, held = held, None
            elif inbox is None:
                try:
                    item = await next_item(stream, model, routing, replica, deadline, limits.stream_idle_timeout_s)
                except StopAsyncIteration:
                    break
                if isinstance(item, Moved) and started.inbox is not None:
                    inbox, ray_end = started.inbox, _watch_end(stream, started.inbox)
                    continue
            else:
                item = await next_chunk(inbox, model, routing, replica, deadline, limits.stream_idle_timeout_s)
            if isinstance(item, _RayEnded):
                item.check()  # raises the replica's failure; a call that ended cleanly: the StreamEnd follows
                continue
            text = account.take(item)
            if text is None:
                break
            if inbox is not None and not inbox.empty():
                text, held = _with_waiting(text, inbox, account)
            yield text
        broke = engine_failure(account.in_band_error)
        if broke is not None:  # vLLM ends a stream whose engine failed with an error event and [DONE]
            log.warning("model %s: stream from replica %s carried an engine error: %s", model.name, replica, broke)
            outcome = Outcome(Ending.ENGINE_ERROR, STREAM_ERROR, why=f"engine error mid-stream: {broke}")
        else:
            outcome = Outcome(Ending.SERVED, 200)
    except DrainTimeout:
        drain = model.draining.timeout_s
        log.warning("model %s: stream from leaving replica %s still ran at the drain timeout (%gs); aborted",
                    model.name, replica, drain)
        outcome = Outcome(Ending.DRAINED, STREAM_ERROR, finished=False)
        yield wire.error_event(
            f"the replica serving this stream of model {model.name!r} was stopped (scale-down, update or "
            f"shutdown) and the stream ran past the drain timeout of {drain:g}s", 503, "replica_drain_timeout")
    except (RequestDeadline, StreamIdle) as exc:
        if isinstance(exc, RequestDeadline):
            code, why = "request_timeout", f"ran past the request timeout of {limits.request_timeout_s:g}s"
        else:
            code, why = "stream_idle_timeout", f"sent nothing for {limits.stream_idle_timeout_s:g}s"
        log.warning("model %s: stream from replica %s %s; ended", model.name, replica, why)
        outcome = Outcome(Ending.TIMED_OUT, STREAM_ERROR, finished=False)
        yield wire.error_event(f"the stream from model {model.name!r} {why}", 504, code)
    except Exception as exc:  # noqa: BLE001 - the stream already started: end it with a clear error event
        why = f"sent nothing for {timeout:g}s" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__
        log.warning("model %s: stream from replica %s broke mid-way: %s", model.name, replica, why)
        outcome = Outcome(Ending.ENGINE_ERROR, STREAM_ERROR, finished=False, why=f"stream broke: {why}")
        yield wire.error_event(f"the stream from model {model.name!r} broke: {why}", 503, "stream_interrupted")
    finally:
        if ray_end is not None and not ray_end.done() and not outcome.finished:
            ray_end.cancel()  # a stream that ended leaves its Ray call to return by itself: no cancellation
        end.settle(outcome)  # cancels the replica's work unless it finished by itself


def _with_waiting(text: str, inbox: asyncio.Queue, account: StreamAccount) -> tuple[str, Any]:
    """`text` and the chunks already waiting behind it, for one write; and the first waiting item that
    is not a chunk (the stream's end, the Ray call's), for the relay to handle next, or None."""
    parts = [text]
    while not inbox.empty():
        item = inbox.get_nowait()
        if not isinstance(item, StreamChunk):
            return "".join(parts), item
        parts.append(account.chunk(item))
    return "".join(parts), None


class _RayEnded:
    """In a moved stream's inbox: its Ray call ended (cleanly, or with the replica's failure)."""

    def __init__(self, call: asyncio.Future):
        self.call = call

    def check(self) -> None:
        if self.call.cancelled():
            return
        exc = self.call.exception()
        if isinstance(exc, StopAsyncIteration):
            return
        if exc is not None:
            raise exc
        raise RuntimeError(f"replica protocol: {self.call.result()!r} on the Ray stream after Moved")


def _watch_end(stream: Any, inbox: asyncio.Queue) -> asyncio.Future:
    """Await the moved stream's Ray call in the background: its end (or failure) joins the inbox, so the
    relay waits on one queue. Nothing but the end is expected there once the stream moved."""
    call = asyncio.ensure_future(stream.__anext__())

    def ended(done: asyncio.Future) -> None:
        if not done.cancelled():
            done.exception()  # retrieved here; the relay reads it from the inbox item
            inbox.put_nowait(_RayEnded(done))

    call.add_done_callback(ended)
    return call


def engine_failure(error: dict[str, Any] | None) -> str | None:
    """The message of an in-band stream error that is the engine's failure (a 5xx code), else None: no
    error, or a client error (a 4xx code, such as a bad tool-call argument found mid-stream; OpenAI's and
    Anthropic's `invalid_request_error` type; the code of a request's own fault the replica found,
    `shunter.engine.RequestFault`)."""
    if error is None:
        return None
    code = error.get("code")
    if (isinstance(code, int) and code < 500) or code == REQUEST_FAULT_CODE \
            or error.get("type") == "invalid_request_error":
        return None
    return str(error.get("message") or code or "engine error")[:300]

