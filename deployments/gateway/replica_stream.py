"""Waiting for a replica's next item: every wait bounded, each bound its own exception.

A replica's reply arrives as items on its Ray stream (`next_item`) or, once a stream moved to the token
channel, in its inbox (`next_chunk`). Each wait ends by the first of: the item; `replica_timeout_s` of
silence (asyncio.TimeoutError: the replica's failure); the client's idle limit when shorter (StreamIdle);
the request's deadline (RequestDeadline); the drain timeout once the replica has left (DrainTimeout).
`Working` heartbeats restart the silence and are shown to `on_working`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

from shunter.config import ModelConfig
from shunter.replica_protocol import Working
from shunter.routing.state import DeploymentRouting


class DrainTimeout(Exception):
    """The replica left (scale-down, update, shutdown) and the request ran past the drain timeout."""


class RequestDeadline(Exception):
    """The request ran past gateway.limits.request_timeout_s."""


class StreamIdle(Exception):
    """The stream sent nothing for gateway.limits.stream_idle_timeout_s (shorter than the model's
    replica_timeout_s, which would count as the replica's failure)."""


async def next_item(stream: Any, model: ModelConfig, routing: DeploymentRouting, replica: str,
                    deadline: float = math.inf, idle_s: float = math.inf,
                    on_working: Callable[[Working], None] | None = None) -> Any:
    """The replica's next item. Raises asyncio.TimeoutError after `replica_timeout_s` of silence (the
    replica's failure), StreamIdle after `idle_s` when that is shorter (the client's limit),
    RequestDeadline at `deadline`, and DrainTimeout once the replica has left the running set for longer
    than the drain timeout (checked every second, so a replica that leaves mid-wait is noticed).
    `on_working` sees each `Working` heartbeat on the way (what a whole reply has produced so far)."""
    silence = model.routing.replica_timeout_s
    silent_until = time.monotonic() + min(silence, idle_s)
    pending = asyncio.ensure_future(stream.__anext__())
    try:
        while True:
            if pending.done() and isinstance(pending.result(), Working):  # alive: the silence starts over
                if on_working is not None:
                    on_working(pending.result())
                silent_until = time.monotonic() + min(silence, idle_s)
                pending = asyncio.ensure_future(stream.__anext__())
            now = time.monotonic()
            wait_s = _wait_left(now, model, routing, replica, deadline, silent_until, idle_s < silence)
            done, _ = await asyncio.wait({pending}, timeout=wait_s)
            if done and not isinstance(pending.result(), Working):
                return pending.result()
    finally:
        if not pending.done():
            pending.cancel()


async def next_chunk(inbox: asyncio.Queue, model: ModelConfig, routing: DeploymentRouting, replica: str,
                     deadline: float = math.inf, idle_s: float = math.inf) -> Any:
    """A moved stream's next item from its token-channel inbox, bounded as `next_item` bounds a Ray
    stream's (an asyncio.Queue's `get` may be cancelled and retried without losing an item)."""
    silence = model.routing.replica_timeout_s
    silent_until = time.monotonic() + min(silence, idle_s)
    while True:
        wait_s = _wait_left(time.monotonic(), model, routing, replica, deadline, silent_until, idle_s < silence)
        if not inbox.empty():
            return inbox.get_nowait()
        try:
            async with asyncio.timeout(wait_s):
                return await inbox.get()
        except TimeoutError:
            continue


def _wait_left(now: float, model: ModelConfig, routing: DeploymentRouting, replica: str, deadline: float,
               silent_until: float, idle_is_shorter: bool) -> float:
    """How long the next wait for a replica's item may last (at most a second, so a replica that leaves
    mid-wait is noticed), or the bound already passed: DrainTimeout once the replica has been gone for
    the drain timeout, RequestDeadline at the request's deadline, and at `silent_until` StreamIdle (the
    client's idle limit, when shorter) or asyncio.TimeoutError (the replica's silence: its failure)."""
    departed = routing.departed_at(replica)
    drain_until = departed + model.draining.timeout_s if departed is not None else math.inf
    if now >= drain_until:
        raise DrainTimeout()
    if now >= deadline:
        raise RequestDeadline()
    if now >= silent_until:
        raise StreamIdle() if idle_is_shorter else TimeoutError()
    return min(silent_until, drain_until, deadline, now + 1.0) - now
