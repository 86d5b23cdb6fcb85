"""The token channel over real ZeroMQ sockets on loopback, without Ray: who may listen, batching per loop
turn, a stream's chunks and end crossing intact (text, counts, cached tokens, error), a gateway gone, and
the gateway's relay of a stream that moves to the channel (the real Forwarder and relay in front of a
stand-in replica that speaks the replica protocol and sends on a real ReplicaChannel)."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
import zmq.asyncio

from shunter.deployments.gateway.replica_stream import DrainTimeout, RequestDeadline, StreamIdle, next_chunk
from shunter.deployments.token_channel import HELLO, ChannelLost, GatewayChannels, ReplicaChannel
from shunter.endpoints import CHAT
from shunter.replica_protocol import Accepted, Moved, ReplyHead, StreamChunk, StreamEnd
from tests.unit.test_forward import (
    DONE,
    MODEL,
    TOKEN,
    USAGE,
    EngineStream,
    Replica,
    _body,
    _request,
    build_pipeline,
)

pytestmark = pytest.mark.unit


async def _until(condition, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not condition():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.005)


def test_chunks_reach_only_a_gateway_whose_id_came_through_ray_and_arrive_in_one_message_per_loop_turn():
    async def run() -> None:
        replica = ReplicaChannel("127.0.0.1")
        gateway = GatewayChannels()
        stranger = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        stranger.setsockopt(zmq.IDENTITY, b"stranger")
        stranger.connect(replica.address)
        await stranger.send(HELLO)
        inbox = gateway.open("r1")
        gateway.connect(replica.address)
        await _until(lambda: replica.ready("stranger"))  # its hello arrived: it is known by its own id only
        assert not replica.ready("stranger-not-announced-by-ray") and not replica.ready("nobody")
        await _until(lambda: replica.ready(gateway.id))
        for i in range(5):  # one loop turn: one message
            replica.send(gateway.id, "r1", StreamChunk(f"chunk {i}", 7, i))
        replica.send(gateway.id, "r1", StreamEnd(7, 5))
        replica.send(gateway.id, "other-request", StreamChunk("not for r1", 1, 1))
        await _until(lambda: inbox.qsize() == 6)
        assert [inbox.get_nowait() for _ in range(6)] == [StreamChunk(f"chunk {i}", 7, i) for i in range(5)] + \
            [StreamEnd(7, 5)]
        # the stranger connected and said hello, but no request ever named it: it got nothing
        assert await stranger.poll(100) == 0
        stranger.close(linger=0)
        replica.close()

    asyncio.run(run())


@pytest.mark.parametrize("end", [
    StreamEnd(40, 3, 32, {"message": "engine died", "type": "InternalServerError", "code": 500}),
    StreamEnd(7, 0),
], ids=["cached_and_error", "bare"])
def test_a_chunk_and_an_end_cross_the_channel_intact(end):
    """The gateway writes a chunk's text as it is and settles at the end's counts: both arrive as the
    replica sent them, typed (the relay tells them apart by type), with the error's fields and an emoji."""
    chunk = StreamChunk('data: {"choices":[{"index":0,"delta":{"content":"h\u00e9 \U0001f600"}}]}\n\n', 40, 2)

    async def run() -> None:
        replica = ReplicaChannel("127.0.0.1")
        gateway = GatewayChannels()
        inbox = gateway.open("r1")
        gateway.connect(replica.address)
        await _until(lambda: replica.ready(gateway.id))
        replica.send(gateway.id, "r1", chunk)
        replica.send(gateway.id, "r1", end)
        await _until(lambda: inbox.qsize() == 2)
        got_chunk, got_end = inbox.get_nowait(), inbox.get_nowait()
        assert type(got_chunk) is StreamChunk and got_chunk == chunk
        assert type(got_end) is StreamEnd and got_end == end
        replica.close()

    asyncio.run(run())


def test_a_gateway_that_went_away_ends_its_streams_on_the_replica():
    async def run() -> None:
        replica = ReplicaChannel("127.0.0.1")
        gateway = GatewayChannels()
        gateway.open("r1")
        gateway.connect(replica.address)
        await _until(lambda: replica.ready(gateway.id))
        for socket, task in gateway._links.values():  # the gateway process dies
            task.cancel()
            socket.close(linger=0)
        # ZeroMQ learns of the disconnect in its own time: chunks sent until then leave into the void,
        # and the first flush after it finds the peer gone.
        loop, sent = asyncio.get_running_loop(), 0
        end = loop.time() + 10
        while replica.ready(gateway.id):
            assert loop.time() < end, "the gateway's disconnect went unnoticed"
            replica.send(gateway.id, "r1", StreamChunk("lost", 3, sent))
            sent += 1
            await asyncio.sleep(0.01)  # the flush runs
        assert sent, "a chunk was sent after the gateway died"
        with pytest.raises(ChannelLost):
            replica.send(gateway.id, "r1", StreamChunk("next", 3, sent))
        replica.close()

    asyncio.run(run())


ROUTING = SimpleNamespace(departed_at=lambda replica: None)


@pytest.mark.parametrize("limit", ["silence", "idle", "deadline", "drain"])
def test_a_moved_streams_wait_is_bounded_like_a_ray_streams(limit):
    model = SimpleNamespace(routing=SimpleNamespace(replica_timeout_s=0.3 if limit == "silence" else 60.0),
                            draining=SimpleNamespace(timeout_s=0.2))
    routing = SimpleNamespace(departed_at=lambda replica: 0.0) if limit == "drain" else ROUTING
    expected = {"silence": asyncio.TimeoutError, "idle": StreamIdle, "deadline": RequestDeadline,
                "drain": DrainTimeout}[limit]

    async def run() -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        inbox.put_nowait("ready")
        deadline = loop.time() + 0.3 if limit == "deadline" else math.inf
        idle = 0.3 if limit == "idle" else math.inf
        if limit != "drain":
            assert await next_chunk(inbox, model, routing, "r", deadline, idle) == "ready"
        with pytest.raises(expected):
            await asyncio.wait_for(next_chunk(inbox, model, routing, "r", deadline, idle), 5)

    asyncio.run(run())


class MovingReplica(Replica):
    """A stand-in replica with a real token channel: the head and first chunk on its Ray stream, then
    `Moved`, the rest over the channel (or, with `fail_after_move`, its Ray call failing instead)."""

    def __init__(self, fail_after_move: bool = False, hang_after_move: bool = False) -> None:
        super().__init__()
        self.fail_after_move, self.hang_after_move = fail_after_move, hang_after_move
        self.channel: ReplicaChannel | None = None
        self.cancelled: list[str] = []

    def remote(self, request: Any) -> Any:
        self.routing.dispatched("replica-1", request.request_id)
        return _Call(self._serve(request), self.cancelled, request.request_id)

    async def _serve(self, request: Any):
        engine = EngineStream.of(request)
        yield Accepted("replica-1", self.channel.address)
        yield ReplyHead(200, None, True)
        yield engine.chunk(TOKEN)
        await _until(lambda: self.channel.ready(request.channel))
        yield Moved()
        for _ in range(3):
            self.channel.send(request.channel, request.request_id, engine.chunk(TOKEN))
            await asyncio.sleep(0.01)
        if self.fail_after_move:
            raise RuntimeError("ActorDiedError: the replica died")
        if self.hang_after_move:
            await asyncio.sleep(3600)
        usage = USAGE.replace('"completion_tokens":1', '"completion_tokens":4')
        assert engine.chunk(usage) is None, "the usage chunk the client did not ask for stays on the replica"
        self.channel.send(request.channel, request.request_id, engine.chunk(DONE))
        self.channel.send(request.channel, request.request_id, engine.end())


class _Call:
    def __init__(self, gen: Any, cancelled: list[str], request_id: str):
        self.gen, self.cancelled, self.request_id = gen, cancelled, request_id

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> Any:
        return await self.gen.__anext__()

    def cancel(self) -> None:
        self.cancelled.append(self.request_id)


@pytest.fixture
def pipeline() -> Any:
    return build_pipeline()


def _moving(pipeline, **kind: bool) -> tuple[Any, MovingReplica]:
    forwarder, replica, traffic = pipeline
    moving = MovingReplica(**kind)
    moving.routing = replica.routing
    forwarder.state.servers["m"]["default"] = moving
    return forwarder, moving


async def _stream_through(forwarder: Any, moving: MovingReplica) -> str:
    """A streamed chat through the real Forwarder to the moving replica: what the client received."""
    moving.channel = ReplicaChannel("127.0.0.1")
    response = await forwarder.forward(_request(_body(stream=True)), CHAT)
    text = "".join([chunk async for chunk in response.body_iterator])
    moving.channel.close()
    return text


def test_a_stream_that_moves_to_the_channel_reaches_the_client_whole_and_in_order(pipeline):
    forwarder, moving = _moving(pipeline)
    settled: list[tuple[int, int]] = []
    forwarder.hooks.register("seen", lambda end, outcome: settled.append(
        (end.ctx.usage.prompt_tokens, end.ctx.usage.completion_tokens)))

    text = asyncio.run(_stream_through(forwarder, moving))
    events = [e for e in text.split("\n\n") if e]
    assert len(events) == 5 and events[-1] == "data: [DONE]", "the first chunk on Ray, three on the channel"
    assert settled == [(3, 4)], "settled at the end's usage, which came over the channel"
    assert all(json.loads(e[len("data: "):])["choices"][0]["delta"]["content"] == "hi" for e in events[:4])
    assert moving.cancelled == [], "a stream that ended is not cancelled"
    assert forwarder.state.gate(MODEL).admitted == 0 and moving.routing.load("replica-1") == 0
    assert forwarder.calls.channels._inboxes == {}, "the inbox is closed with the request"


def test_a_replica_failing_after_the_move_ends_the_stream_with_an_error_event(pipeline):
    forwarder, moving = _moving(pipeline, fail_after_move=True)

    text = asyncio.run(_stream_through(forwarder, moving))
    last = json.loads(text.strip().split("\n\n")[-1][len("data: "):])
    assert last["error"]["code"] == "stream_interrupted" and "RuntimeError" in last["error"]["message"]
    assert text.count('"content":"hi"') == 4, "every chunk sent before the failure reached the client"
    assert forwarder.state.gate(MODEL).admitted == 0 and forwarder.calls.channels._inboxes == {}


def test_a_client_leaving_a_moved_stream_cancels_the_replicas_work_and_closes_the_inbox(pipeline):
    forwarder, moving = _moving(pipeline, hang_after_move=True)

    async def run() -> None:
        moving.channel = ReplicaChannel("127.0.0.1")
        response = await forwarder.forward(_request(_body(stream=True)), CHAT)
        body = response.body_iterator
        for _ in range(4):
            await body.__anext__()
        await body.aclose()  # the client hung up
        moving.channel.close()

    asyncio.run(run())
    assert len(moving.cancelled) == 1, "the replica's work is cancelled"
    assert forwarder.state.gate(MODEL).admitted == 0 and forwarder.calls.channels._inboxes == {}
