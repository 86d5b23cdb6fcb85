"""The token channel: a stream's chunks from a model replica to the gateway process that asked for them,
batched per engine step over one ZeroMQ connection per (gateway process, replica), instead of one Ray
message per chunk per stream.

Why: at 32 streams one engine step yields 32 chunks, and Ray Serve moves each as its own message through
the replica's and the gateway's Ray machinery (serialisation, the core worker, thread hand-offs): about
three quarters of the serving CPU per token was that, measured with py-spy (docs/design.md). vLLM's own
front end talks to its engine the same way this channel does: ZeroMQ, one batch per step.

What stays on Ray: the request itself (routing through the request router, `max_ongoing_requests`,
cancellation, drain and the replica's death are all Ray's), `Accepted`, the reply head and the first
chunk (so a replica that fails before the first byte is still failed over). Then the replica moves the
rest of the stream to the channel: it yields `Moved` on the Ray stream, sends the remaining chunks and the
stream's `StreamEnd` on the channel, and its Ray call returns when the engine's stream is done. A chunk
travels as `(request id, text, prompt tokens, completion tokens)`, the end as `(request id, None, prompt,
completion, cached, error)`: the gateway writes the text as it is and parses nothing. The gateway
reads the Ray stream until `Moved`, then the request's inbox; the Ray call still ends the request (its
failure is the stream's failure, the client's hang-up cancels it, which aborts the engine's work).

Who may listen: the replica binds a ROUTER socket on its node's address; a gateway process connects a
DEALER whose identity is a random 128-bit id, and the replica sends to an identity only after that id
came to it inside a request through Ray (authenticated) and its hello arrived on the socket. A peer that
does not know a gateway's id receives nothing.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from shunter.replica_protocol import StreamChunk, StreamEnd

log = logging.getLogger("ray.serve")

HELLO = b"hello"
MAX_LINKS = 512  # a gateway's connections to replicas, least recently used closed first


class ChannelLost(Exception):
    """The gateway this stream was for is no longer connected."""


class ReplicaChannel:
    """A model replica's side: one ROUTER socket, an outbox per gateway flushed once per loop turn."""

    def __init__(self, host: str):
        self._socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer is an error, never a silent drop
        self._socket.setsockopt(zmq.SNDHWM, 0)  # streams are bounded by their max_tokens, not by the socket
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        # Sends go through a plain socket over the same ZeroMQ socket (this loop's thread only): a send never
        # waits (no high-water mark), and a copied small frame with no future to resolve costs half of an
        # asyncio send without copying (measured: 3.7 against 7.6 us for a step's message).
        self._sender = zmq.Socket.shadow(self._socket.underlying)
        self._greeted: set[bytes] = set()  # ids whose hello arrived
        self._lost: set[bytes] = set()
        self._outbox: dict[bytes, list[tuple[Any, ...]]] = {}
        self._flush_scheduled = False
        self._listener = asyncio.get_running_loop().create_task(self._listen())

    def ready(self, gateway: str) -> bool:
        """Whether chunks for `gateway` (its channel id, as it came inside a Ray request) can go over the
        channel: that gateway said hello and was not lost since."""
        key = gateway.encode()
        return key in self._greeted and key not in self._lost

    def send(self, gateway: str, request_id: str, item: StreamChunk | StreamEnd) -> None:
        """Queue one chunk (or the stream's end) for the gateway; everything queued in this loop turn leaves
        in one message. Raises ChannelLost when that gateway is gone."""
        key = gateway.encode()
        if key in self._lost:
            raise ChannelLost(gateway)
        self._outbox.setdefault(key, []).append(
            (request_id, *item) if isinstance(item, StreamChunk) else (request_id, None, *item))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        outbox, self._outbox = self._outbox, {}
        for key, items in outbox.items():
            try:
                self._sender.send_multipart([key, msgpack.packb(items)], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the gateway disconnected (EHOSTUNREACH): its streams end
                log.warning("token channel: gateway %s unreachable (%s); %d chunk(s) dropped",
                            key.decode(errors="replace")[:8], exc, len(items))
                self._lost.add(key)
                self._greeted.discard(key)

    async def _listen(self) -> None:
        while True:
            try:
                frames = await self._socket.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return  # closed
            if len(frames) == 2 and frames[1] == HELLO:
                self._greeted.add(frames[0])
                self._lost.discard(frames[0])

    def close(self) -> None:
        self._listener.cancel()
        self._socket.close(linger=0)


class GatewayChannels:
    """A gateway process's side: its id, a DEALER per replica address, and the inboxes of its streams."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        self._context = zmq.asyncio.Context.instance()
        self._links: OrderedDict[str, tuple[zmq.asyncio.Socket, asyncio.Task]] = OrderedDict()
        self._inboxes: dict[str, asyncio.Queue[Any]] = {}

    def open(self, request_id: str) -> asyncio.Queue[Any]:
        """The inbox of a request about to be sent: its `StreamChunk`s in order, then its `StreamEnd` (they
        may arrive before the replica's `Moved` does on Ray)."""
        inbox = self._inboxes[request_id] = asyncio.Queue()
        return inbox

    def close(self, request_id: str) -> None:
        self._inboxes.pop(request_id, None)

    def connect(self, address: str | None) -> None:
        """Make sure this process listens to the replica at `address` (from its `Accepted`)."""
        if not address:
            return
        if address in self._links:
            self._links.move_to_end(address)
            return
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, self.id.encode())
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        socket.send(HELLO, flags=zmq.NOBLOCK)
        self._links[address] = (socket, asyncio.get_running_loop().create_task(self._receive(socket)))
        while len(self._links) > MAX_LINKS:
            _, (old, task) = self._links.popitem(last=False)
            task.cancel()
            old.close(linger=0)

    async def _receive(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            try:
                payload = await socket.recv()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return  # closed
            for request_id, text, *rest in msgpack.unpackb(payload):
                inbox = self._inboxes.get(request_id)
                if inbox is not None:  # else: the request already ended (its client left)
                    inbox.put_nowait(StreamChunk(text, *rest) if text is not None else StreamEnd(*rest))
