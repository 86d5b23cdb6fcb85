"""The gateway's body reader on its own: a slow body needs an upload slot, a body the gateway itself was
too busy to read does not (the CI failure: 503 `too_many_uploads` for bodies sent whole during a burst)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import uvloop

from shunter.config import GatewayConfig
from shunter.deployments.gateway.request_body import FAST_BODY_S, BodyReader
from shunter.errors import ApiError


class _Request:
    """What `BodyReader` reads of a Starlette request: its headers and its body stream, here the bytes that
    arrive on a real socket, read by the event loop as uvicorn's protocol reads them."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int):
        self.headers = {"content-length": str(size), "content-type": "application/json"}
        self._reader, self._size = reader, size
        self._writer = writer  # held: a collected writer closes the connection

    async def stream(self):
        left = self._size
        while left:
            chunk = await self._reader.read(left)
            if not chunk:
                return
            left -= len(chunk)
            yield chunk


async def _client_and_request(size: int) -> tuple[socket.socket, _Request]:
    """A connected socket pair: the client's end (a plain blocking socket, written from a timer as the
    kernel receives a client's bytes) and the request whose body the loop reads from the other end."""
    client, server = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=server)
    return client, _Request(reader, writer, size)


LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def _run(loop: str, main):
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        return runner.run(main())


def _reader(upload_slots: int = 1, timeout_s: float = 10.0) -> BodyReader:
    return BodyReader(GatewayConfig(max_body_reads=upload_slots, body_timeout_s=timeout_s))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_body_that_arrived_while_the_loop_was_blocked_needs_no_upload_slot(loop):
    """The body is in the socket by 0.1 s, but the loop is blocked from 0.05 s to past the fast window, so
    the window's timer and the socket's read are due in the same late pass; uvloop (what uvicorn runs)
    fires timers before it polls the sockets. Every upload slot is taken: judged by wall time alone this
    is a 503, but the gateway's own lag is not the client's slowness."""
    body = b'{"a": 1}'

    async def main() -> bytes:
        reader = _reader(upload_slots=1)
        await reader._upload_slots.acquire()  # the one slot is held by a real slow upload
        client, request = await _client_and_request(len(body))
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, time.sleep, FAST_BODY_S + 0.3)  # the gateway busy with other requests
        loop.call_later(0.1, client.sendall, body)
        try:
            return await reader._read(request)
        finally:
            client.close()

    assert _run(loop, main) == body


@pytest.mark.parametrize("loop", LOOPS)
def test_a_slow_body_on_a_responsive_gateway_is_refused_when_every_upload_slot_is_taken(loop):
    async def main() -> ApiError:
        reader = _reader(upload_slots=1)
        await reader._upload_slots.acquire()
        client, request = await _client_and_request(100)
        client.sendall(b"{")  # and nothing more
        try:
            with pytest.raises(ApiError) as refused:
                await reader._read(request)
            return refused.value
        finally:
            client.close()

    error = _run(loop, main)
    assert (error.status, error.code) == (503, "too_many_uploads")


@pytest.mark.parametrize("loop", LOOPS)
def test_a_slow_body_with_a_free_upload_slot_is_read_or_timed_out(loop):
    body = b'{"late": true}'

    async def main(arrives_after: float | None) -> bytes:
        reader = _reader(upload_slots=1, timeout_s=1.5)
        client, request = await _client_and_request(len(body))
        if arrives_after is not None:
            asyncio.get_running_loop().call_later(arrives_after, client.sendall, body)
        try:
            return await reader._read(request)
        finally:
            client.close()

    assert _run(loop, lambda: main(FAST_BODY_S + 0.3)) == body
    with pytest.raises(ApiError) as refused:
        _run(loop, lambda: main(None))
    assert (refused.value.status, refused.value.code) == (408, "body_timeout")
