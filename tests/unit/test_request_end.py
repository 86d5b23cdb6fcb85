"""Every way a request ends settles it exactly once: its single typed `Outcome` on its context, and every
end-of-request hook run once on it (the replica's work and the routers' in-flight count, the breaker, the
version's rollout record, the admission slot and dispatch turn, telemetry, the caller's quota), then the
request's own `on_outcome` callbacks.

Two parts. First, the real RequestEnd, standard hooks, AdmissionGate, FlowQueue, DrainTracker,
RequestTelemetry, StreamAccount, stream relay and ASGI guard, around recording stand-ins for the replica's
stream, the routing state and the quota ticket (each counts what was done to it). Then the enumeration:
every ending, whole and streamed, for every endpoint, driven through the real Forwarder (under the
gateway's ASGI guard, as in production) in front of a scripted stand-in replica speaking each endpoint's
own stream format, with counting hooks in place of the gateway's.

A stand-in replica's stream is written as the events its engine sends; it yields what a real replica
makes of them (issue 39: relay bytes, not objects): each through the replica's real StreamReader beside a
stand-in engine count (`tests.unit.test_forward.EngineStream`), then the stream's StreamEnd. So the usage
chunk a client did not ask for is dropped by the replica's reader, before the gateway.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.responses import StreamingResponse
from starlette.requests import Request as HttpRequest

from shunter.config import LimitsConfig, parse_config
from shunter.deployments.gateway.context import (
    CLIENT_GONE,
    STREAM_ERROR,
    Ending,
    Outcome,
    RequestContext,
    client_gone,
    refused,
    served,
)
from shunter.deployments.gateway.draining import DrainTracker
from shunter.deployments.gateway.flow.admission import AdmissionGate
from shunter.deployments.gateway.flow.queue import FlowQueue
from shunter.deployments.gateway.parsed_request import warm_up
from shunter.deployments.gateway.relay import relay
from shunter.deployments.gateway.replica_call import Started
from shunter.deployments.gateway.request_end import (
    STATE_KEY,
    EndHooks,
    Reply,
    RequestEnd,
    SettleUnsettled,
    finish_telemetry,
    record_breaker,
    release_admission,
    release_replica,
    rollout_hook,
    settle_quota,
    standard_hooks,
)
from shunter.deployments.gateway.stream_account import StreamAccount
from shunter.deployments.gateway.telemetry import RequestTelemetry
from shunter.deployments.gateway.usage import record_usage
from shunter.endpoints import CHAT, ENDPOINTS, MESSAGES, Endpoint, ParsedRequest
from shunter.replica_protocol import Accepted, ReplyHead, Working
from shunter.usage_ledger import UsageRecord
from shunter.wire_formats import OPENAI_CHUNKS, anthropic_error
from tests.unit.test_forward import EngineStream, Replica, _request, build_pipeline

pytestmark = pytest.mark.unit

MODEL = parse_config({"models": [{"name": "smol", "source": "builtin:smollm2-135m-instruct"}]}).models[0]
LIMITS = LimitsConfig()
TOKEN = 'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = 'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n'
ENGINE_ERROR = 'data: {"error":{"message":"engine died","code":500}}\n\n'


class ReplicaStream:
    """The replica's response to a chat stream whose engine sends `events` (an exception instance is raised
    where it stands: the replica broke): each event as the replica yields it (`EngineStream`; `counted`:
    the engine says its running count), then the stream's end; or, with `hang`, silence after them."""

    def __init__(self, events: list[Any], hang: bool = False, counted: bool = True):
        self.items, self.hang, self.cancels = list(events), hang, 0
        self.engine, self.ended = EngineStream(OPENAI_CHUNKS, prompt=5, counted=counted), False

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> Any:
        while self.items:
            item = self.items.pop(0)
            if isinstance(item, BaseException):
                raise item
            chunk = self.engine.chunk(item)
            if chunk is not None:
                return chunk
        if self.hang:
            await asyncio.sleep(3600)
        if not self.ended:
            self.ended = True
            return self.engine.end()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancels += 1


class Routing:
    def __init__(self, departed: float | None = None):
        self.departed, self.finished_ids, self.outcomes = departed, [], []

    def finished(self, routing_id: str, cached_tokens: int | None = None, prompt_tokens: int = 0) -> None:
        self.finished_ids.append(routing_id)

    def departed_at(self, replica: str) -> float | None:
        return self.departed

    def record_outcome(self, replica: str, failed: bool, why: str = "") -> None:
        self.outcomes.append(failed)


class Ticket:
    def __init__(self):
        self.settles: list[tuple[str, int, int]] = []
        self.reached_engine: list[bool] = []

    def settle(self, status: int | str, prompt: int, completion: int, reached_engine: bool = True) -> None:
        self.settles.append((str(status), prompt, completion))
        self.reached_engine.append(reached_engine)


class Rollouts:
    """Records what the rollout hook tells the version's traffic record (LiveVersions.record_request)."""

    def __init__(self) -> None:
        self.oks: list[bool] = []

    def record_request(self, model: Any, adapter: Any, version: str, ok: bool, ttft_s: float | None,
                       e2e_s: float | None) -> None:
        self.oks.append(ok)


class Request:
    """One request's obligations, taken the way the forward pipeline takes them."""

    def __init__(self, stream: ReplicaStream | None = None, admitted: bool = True, departed: float | None = None,
                 streamed: bool = False):
        self.ctx = RequestContext(CHAT, ParsedRequest(CHAT, {}, stream=streamed), MODEL, "req-1")
        self.ctx.ticket = self.ticket = Ticket()
        self.tel = RequestTelemetry(self.ctx, {})
        self.rollouts = Rollouts()
        self.versions = self.rollouts.oks
        self.end = RequestEnd(self.ctx, self.tel, standard_hooks(self.rollouts))  # type: ignore[arg-type]
        self.callbacks: list[Outcome | None] = []  # the request's own on_outcome callbacks (the tier's)
        self.ctx.on_outcome.append(lambda c: self.callbacks.append(c.outcome))
        self.gate, self.routing = AdmissionGate(4), Routing(departed)
        self.drains = DrainTracker("smol")
        self.stream = stream
        self.queue = FlowQueue(lambda: 4)
        if admitted:
            assert self.gate.try_admit(4) is None
            self.end.hold(self.gate)
            self.queue.dispatched += 1  # its turn came at once (FlowQueue.enter with room)
            self.end.dispatched(self.queue)

    def answered(self) -> Started:
        streamed = self.ctx.parsed.stream
        self.end.attach(Reply(self.stream, "replica-a", "rid.1", self.routing, "default",  # type: ignore[arg-type]
                              time.monotonic(), 0.01, streamed, drains=self.drains if streamed else None))
        return Started("replica-a", ReplyHead(200, None, streamed), self.stream, None, "rid.1")

    def body(self, started: Started, limits: LimitsConfig = LIMITS) -> Any:
        """The client's stream, as the forward pipeline builds it."""
        account = StreamAccount(self.ctx.usage, self.tel.token)
        first = account.take(started.first_chunk) if started.first_chunk is not None else None
        return relay(started, self.end, account, first, limits)

    def assert_settled_once(self, ending: Ending, status: int | str, cancelled: bool, outcome: list[bool]) -> None:
        assert self.end.settled and self.tel._done
        assert (self.ctx.outcome.ending, self.ctx.outcome.status) == (ending, status)  # type: ignore[union-attr]
        assert self.callbacks == [self.ctx.outcome], "the request's own callbacks, once, after the hooks"
        assert [s for s, _, _ in self.ticket.settles] == [str(status)], "quota settled once, at the client's status"
        assert self.gate.admitted == 0, "the admission slot is back"
        assert self.queue.dispatched == 0, "the dispatch turn is back"
        if self.end.reply is not None:
            assert self.routing.finished_ids == ["rid.1"], "the routers' in-flight count, once"
            assert self.drains.open == {}, "no stream left counted open on the replica"
        assert (self.stream.cancels > 0 if self.stream else False) == cancelled
        assert self.versions == outcome, "the version's traffic record"


async def drain_relay(req: Request, started: Started, limits: LimitsConfig = LIMITS,
                      stop_after: int | None = None) -> list[str]:
    chunks, body = [], req.body(started, limits)
    async for chunk in body:
        chunks.append(chunk)
        if stop_after is not None and len(chunks) >= stop_after:
            await body.aclose()  # the client hung up
            break
    return chunks


# ---- whole replies and refusals: the forward pipeline settles them with the status it returns ------------

def test_a_whole_reply_settles_at_its_status():
    req = Request(ReplicaStream([]))
    req.answered()
    req.end.settle(served(200))
    req.assert_settled_once(Ending.SERVED, 200, cancelled=False, outcome=[True])
    assert req.routing.outcomes == [False], "a success for the replica's breaker"


@pytest.mark.parametrize(("outcome", "admitted"), [
    (refused(429), False), (refused(403), False), (refused(503), True),
    (Outcome(Ending.TIMED_OUT, 504, finished=False), True),
])
def test_a_refusal_or_a_timeout_before_any_reply_gives_everything_back(outcome, admitted):
    """429/403 from the door (no slot taken), 503 when no version could start, 504 at the deadline."""
    req = Request(admitted=admitted)
    req.end.settle(outcome)
    req.assert_settled_once(outcome.ending, outcome.status, cancelled=False, outcome=[])


def test_a_client_gone_while_a_whole_reply_runs_is_a_499_and_stops_the_replica():
    req = Request(ReplicaStream([]))
    req.answered()
    req.end.settle(client_gone())
    req.assert_settled_once(Ending.CLIENT_GONE, CLIENT_GONE, cancelled=True, outcome=[])
    assert req.routing.outcomes == [], "a client leaving says nothing about the replica"


def test_a_whole_reply_whose_client_left_is_charged_what_its_replica_last_reported():
    """The client left before the reply: the door's cancellation settles it at the replica's last
    heartbeat (its prompt and the completion tokens so far), not at nothing, not at the reservation."""
    req = Request()
    req.ctx.usage.new_attempt()
    req.ctx.usage.working(Working(prompt_tokens=35, completion_tokens=12))
    req.ctx.usage.working(Working(prompt_tokens=35, completion_tokens=40))
    req.end.settle(client_gone())
    req.assert_settled_once(Ending.CLIENT_GONE, CLIENT_GONE, cancelled=False, outcome=[])
    assert req.ticket.settles == [("499", 35, 40)]


def test_a_heartbeat_counts_only_for_its_own_attempt_and_never_for_a_reply_that_came():
    retried = Request()
    retried.ctx.usage.new_attempt()  # what each attempt does first (shunter.deployments.gateway.replica_call)
    retried.ctx.usage.working(Working(prompt_tokens=35, completion_tokens=12))
    retried.ctx.usage.new_attempt()  # that replica died; the retry starts over
    retried.end.settle(client_gone())
    assert retried.ticket.settles == [("499", 0, 0)], "nothing reported yet: the ticket charges its estimate"
    answered = Request(ReplicaStream([]))
    answered.ctx.usage.new_attempt()
    answered.ctx.usage.working(Working(prompt_tokens=35, completion_tokens=12))
    answered.ctx.usage.whole_reply({"usage": {"prompt_tokens": 35, "completion_tokens": 20}})
    answered.answered()
    answered.end.settle(served(200))
    assert answered.ticket.settles == [("200", 35, 20)], "the reply's own usage"


def test_settling_twice_does_nothing_the_second_time():
    req = Request(ReplicaStream([]))
    req.answered()
    req.end.settle(served(200))
    req.end.settle(Outcome(Ending.GATEWAY_ERROR, 500, finished=False))
    req.assert_settled_once(Ending.SERVED, 200, cancelled=False, outcome=[True])


# ---- streams: the relay settles them however they end ------------------------------------------------------

@pytest.mark.parametrize("counted", [True, False], ids=["engine_counts", "final_usage_only"])
def test_a_stream_served_whole_is_a_200_with_its_tokens_counted(counted):
    req = Request(ReplicaStream([TOKEN, TOKEN, USAGE], counted=counted), streamed=True)
    chunks = asyncio.run(drain_relay(req, req.answered()))
    assert chunks == [TOKEN, TOKEN]  # the usage chunk the client did not ask for is dropped (by the replica)
    req.assert_settled_once(Ending.SERVED, 200, cancelled=False, outcome=[True])
    assert req.ticket.settles == [("200", 5, 2)]
    assert req.routing.outcomes == [False], "a success for the replica's breaker"


def test_an_engine_error_inside_the_stream_is_a_stream_error_and_the_versions_failure():
    req = Request(ReplicaStream([TOKEN, ENGINE_ERROR, "data: [DONE]\n\n"]), streamed=True)
    asyncio.run(drain_relay(req, req.answered()))
    req.assert_settled_once(Ending.ENGINE_ERROR, STREAM_ERROR, cancelled=False, outcome=[False])
    assert req.routing.outcomes == [True], "the replica's failure"


def test_a_replica_that_breaks_mid_stream_ends_it_with_an_error_event():
    req = Request(ReplicaStream([TOKEN, RuntimeError("actor died")]), streamed=True)
    chunks = asyncio.run(drain_relay(req, req.answered()))
    assert json.loads(chunks[-1].removeprefix("data: "))["error"]["code"] == "stream_interrupted"
    req.assert_settled_once(Ending.ENGINE_ERROR, STREAM_ERROR, cancelled=True, outcome=[False])
    assert req.routing.outcomes == [True], "the replica's failure"


def test_a_client_that_hangs_up_mid_stream_is_a_499_and_stops_the_replica():
    req = Request(ReplicaStream([TOKEN, TOKEN, TOKEN]), streamed=True)
    asyncio.run(drain_relay(req, req.answered(), stop_after=1))
    req.assert_settled_once(Ending.CLIENT_GONE, CLIENT_GONE, cancelled=True, outcome=[])
    assert req.ticket.settles == [("499", 5, 1)], "charged what the engine had produced when it was cut"


@pytest.mark.parametrize(("limits", "code"), [
    (LimitsConfig(request_timeout_s=0.3), "request_timeout"),
    (LimitsConfig(stream_idle_timeout_s=0.3), "stream_idle_timeout"),
])
def test_a_stream_cut_by_a_limit_ends_with_a_504_event(limits, code):
    req = Request(ReplicaStream([TOKEN], hang=True), streamed=True)
    chunks = asyncio.run(drain_relay(req, req.answered(), limits))
    event = json.loads(chunks[-1].removeprefix("data: "))["error"]
    assert event["code"] == code
    req.assert_settled_once(Ending.TIMED_OUT, STREAM_ERROR, cancelled=True, outcome=[])


def test_a_stream_on_a_replica_past_its_drain_timeout_is_aborted():
    req = Request(ReplicaStream([TOKEN], hang=True), departed=time.monotonic() - MODEL.draining.timeout_s - 1,
                  streamed=True)
    chunks = asyncio.run(drain_relay(req, req.answered()))
    assert json.loads(chunks[-1].removeprefix("data: "))["error"]["code"] == "replica_drain_timeout"
    req.assert_settled_once(Ending.DRAINED, STREAM_ERROR, cancelled=True, outcome=[])


# ---- the ASGI guard: a request the pipeline never settled -------------------------------------------------

async def _ignore(message: dict[str, Any]) -> None:
    return None


async def _disconnected() -> dict[str, Any]:
    return {"type": "http.disconnect"}


@pytest.mark.parametrize("how", ["returned", "raised", "cancelled"])
def test_a_stream_whose_response_never_started_is_settled_by_the_asgi_guard(how):
    """The client left before the first byte: the relay never ran, so its `finally` never did. However the
    app's call ends (the response dropped, an error, Serve cancelling the route), the guard settles it."""
    req = Request(ReplicaStream([TOKEN]), streamed=True)
    bodies = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        scope.setdefault("state", {})[STATE_KEY] = req.end  # as Forwarder.forward does
        bodies.append(req.body(req.answered()))  # the response's body, never iterated
        if how == "raised":
            raise RuntimeError("the response failed before it started")
        if how == "cancelled":
            raise asyncio.CancelledError()

    async def run() -> None:
        call = SettleUnsettled(app)({"type": "http"}, _disconnected, _ignore)
        if how == "returned":
            await call
        else:
            with pytest.raises(RuntimeError if how == "raised" else asyncio.CancelledError):
                await call

    asyncio.run(run())
    req.assert_settled_once(Ending.CLIENT_GONE, CLIENT_GONE, cancelled=True, outcome=[])
    assert req.routing.finished_ids == ["rid.1"] and req.drains.open == {}
    assert req.stream is not None and req.stream.cancels == 1


def test_the_asgi_guard_leaves_a_settled_request_and_other_scopes_alone():
    req = Request(ReplicaStream([]))
    seen = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["type"])
        if scope["type"] == "http":
            scope["state"] = {STATE_KEY: req.end}
            req.answered()
            req.end.settle(served(200))

    async def run() -> None:
        await SettleUnsettled(app)({"type": "lifespan"}, _disconnected, _ignore)
        await SettleUnsettled(app)({"type": "http"}, _disconnected, _ignore)
        await SettleUnsettled(app)({"type": "http", "state": {}}, _disconnected, _ignore)  # nothing to settle

    asyncio.run(run())
    assert seen == ["lifespan", "http", "http"]
    req.assert_settled_once(Ending.SERVED, 200, cancelled=False, outcome=[True])


# ---- the hooks ---------------------------------------------------------------------------------------------

STANDARD = ("replica", "breaker", "rollout", "admission", "telemetry", "quota", "usage")


def test_the_standard_hooks_run_in_their_order_and_a_failing_one_never_stops_the_others(caplog):
    assert standard_hooks(Rollouts()).names == list(STANDARD)  # type: ignore[arg-type]
    ran: list[str] = []
    hooks = EndHooks()
    hooks.register("first", lambda end, outcome: ran.append("first"))
    hooks.register("broken", lambda end, outcome: 1 / 0)
    hooks.register("last", lambda end, outcome: ran.append("last"))
    with pytest.raises(ValueError, match="registered twice"):
        hooks.register("last", lambda end, outcome: None)
    ctx = RequestContext(CHAT, ParsedRequest(CHAT, {}), MODEL, "req-7")
    callbacks = []
    ctx.on_outcome.append(lambda c: 1 / 0)
    ctx.on_outcome.append(lambda c: callbacks.append(c.outcome))
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        RequestEnd(ctx, RequestTelemetry(ctx, {}), hooks).settle(served(200))
    assert ran == ["first", "last"] and callbacks == [served(200)]
    assert "end-of-request hook broken failed" in caplog.text and "an outcome callback failed" in caplog.text


# ---- every way a request ends, for every endpoint, through the real Forwarder -------------------------------

class CountingHooks:
    """The standard hooks under their standard names, each counted (with the RequestEnd it ran for) before it
    runs; the rollout hook records into `rollouts`."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, RequestEnd]] = []
        recorder = Rollouts()
        self.rollouts = recorder.oks
        self.hooks = EndHooks()
        record = rollout_hook(recorder)  # type: ignore[arg-type]
        self.records: list[UsageRecord] = []  # what the usage hook gave the ledger's writer
        writer = SimpleNamespace(add=self.records.append)
        for name, hook in (("replica", release_replica), ("breaker", record_breaker), ("rollout", record),
                           ("admission", release_admission), ("telemetry", finish_telemetry),
                           ("quota", settle_quota), ("usage", record_usage(writer))):  # type: ignore[arg-type]
            self.hooks.register(name, self._counted(name, hook))
        assert self.hooks.names == standard_hooks(recorder).names, "every standard hook is counted"  # type: ignore[arg-type]

    def _counted(self, name: str, hook: Callable[[RequestEnd, Outcome], None]) -> Callable[[RequestEnd, Outcome], None]:
        def run(end: RequestEnd, outcome: Outcome) -> None:
            self.ran.append((name, end))
            hook(end, outcome)

        return run

    @property
    def end(self) -> RequestEnd | None:
        ends = {id(end): end for _, end in self.ran}
        assert len(ends) <= 1, "one RequestEnd per request"
        return next(iter(ends.values()), None)


class _Hang:
    """The replica goes silent here (and says so, so the test knows where the request stands)."""


class _Slow:
    """The replica sends a token every 10 ms from here on, forever: never idle, never done."""


class _Depart:
    """The replica leaves the running set here (scale-down, update): its drain clock starts."""


HANG, SLOW, DEPART = _Hang(), _Slow(), _Depart()


class ScriptedStream:
    """One call's answer: the script's replica-protocol items as they are, and its engine's SSE texts as the
    replica yields them (`EngineStream`), a streamed reply ending with its StreamEnd when the script runs out."""

    def __init__(self, items: list[Any], replica: ScriptedReplica, engine: EngineStream):
        self.items, self.replica, self.engine, self.cancelled = items, replica, engine, False
        self.streams = self.ended = False  # its head said a stream follows; its end was sent

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> Any:
        while True:
            if not self.items:
                if self.streams and not self.ended:
                    self.ended = True
                    return self.engine.end()
                raise StopAsyncIteration
            item = self.items[0]
            if item is SLOW:
                await asyncio.sleep(0.01)
                return self.engine.chunk(self.replica.wire.token)
            self.items.pop(0)
            if item is HANG:
                self.replica.hanging = True
                await asyncio.sleep(3600)
            elif item is DEPART:
                self.replica.routing.sync_replicas(["replica-1"])
                self.replica.routing.sync_replicas([])
            elif isinstance(item, BaseException):
                raise item
            elif isinstance(item, str):
                chunk = self.engine.chunk(item)
                if chunk is not None:
                    return chunk
            else:
                self.streams = self.streams or (isinstance(item, ReplyHead) and item.stream)
                return item

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedReplica(Replica):
    """A replica whose every call answers `script` (the retry after a failure gets the script again)."""

    def __init__(self, script: list[Any], wire: Wire):
        super().__init__()
        # Its own routing state (the process keeps one per deployment): no breaker carries over from a case.
        self.deployment_name = f"model-{uuid.uuid4().hex[:12]}"
        self.script, self.wire, self.hanging = script, wire, False
        self.streams: list[ScriptedStream] = []

    def remote(self, request: Any) -> ScriptedStream:
        self.routing.dispatched("replica-1", request.request_id)
        stream = ScriptedStream(list(self.script), self, EngineStream.of(request, prompt=self.wire.usage[0]))
        self.streams.append(stream)
        return stream


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _data(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class Wire:
    """One endpoint, as its client sends it and its replica's engine answers it: the request body, the whole
    reply, and its stream's events (the first ones, a token, the end with the final usage, an engine error
    and a client error in the stream with what follows them)."""

    body: dict[str, Any]
    whole: dict[str, Any]
    usage: tuple[int, int]  # (prompt, completion) of the whole reply and of a stream served whole
    prelude: tuple[str, ...] = ()
    token: str = ""
    final: tuple[str, ...] = ()
    engine_error: tuple[str, ...] = ()
    client_error: tuple[str, ...] = ()


def _openai_token(delta: dict[str, Any]) -> str:
    """A token chunk as vLLM sends it to a client that asked for no running usage."""
    return _data({"choices": [{"index": 0, **delta}]})


_MESSAGES = [{"role": "user", "content": "hello"}]
_OPENAI_END = (_data({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}), "data: [DONE]\n\n")
_OPENAI_ENGINE_ERROR = (_data({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}),
                        "data: [DONE]\n\n")
_OPENAI_CLIENT_ERROR = (_data({"error": {"message": "bad tool arguments", "type": "BadRequestError", "code": 400}}),
                        "data: [DONE]\n\n")
_DELTA = "response.output_text.delta"
WIRES = {
    "chat": Wire({"model": "m", "messages": _MESSAGES, "max_tokens": 4},
                 {"object": "chat.completion", "choices": [{"index": 0, "message": {"content": "hi"}}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, (3, 2),
                 token=_openai_token({"delta": {"content": "hi"}}), final=_OPENAI_END,
                 engine_error=_OPENAI_ENGINE_ERROR, client_error=_OPENAI_CLIENT_ERROR),
    "completion": Wire({"model": "m", "prompt": "hello", "max_tokens": 4},
                       {"object": "text_completion", "choices": [{"index": 0, "text": "hi"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, (3, 2),
                       token=_openai_token({"text": "hi"}), final=_OPENAI_END,
                       engine_error=_OPENAI_ENGINE_ERROR, client_error=_OPENAI_CLIENT_ERROR),
    "embedding": Wire({"model": "e", "input": "hello"},
                      {"object": "list", "data": [{"index": 0, "embedding": [0.1, 0.2]}],
                       "usage": {"prompt_tokens": 3, "total_tokens": 3}}, (3, 0)),
    "responses": Wire({"model": "m", "input": "hello", "max_output_tokens": 4},
                      {"object": "response", "output": [], "usage": {"input_tokens": 3, "output_tokens": 2}}, (3, 2),
                      prelude=(_sse("response.created", {"type": "response.created", "response": {}}),),
                      token=_sse(_DELTA, {"type": _DELTA, "delta": "hi"}),
                      final=(_sse("response.completed", {"type": "response.completed", "response": {
                          "usage": {"input_tokens": 3, "output_tokens": 2}}}),),
                      engine_error=(_sse("error", {"type": "error", "code": 500, "message": "engine died"}),),
                      client_error=(_sse("error", {"type": "error", "code": 400, "message": "bad arguments"}),)),
    "messages": Wire({"model": "m", "max_tokens": 4, "messages": _MESSAGES},
                     {"type": "message", "content": [{"type": "text", "text": "hi"}],
                      "usage": {"input_tokens": 3, "output_tokens": 2}}, (3, 2),
                     prelude=(_sse("message_start", {"type": "message_start", "message": {
                         "usage": {"input_tokens": 3, "output_tokens": 0}}}),),
                     token=_sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                        "delta": {"type": "text_delta", "text": "hi"}}),
                     final=(_sse("message_delta", {"type": "message_delta", "usage": {"output_tokens": 2}}),
                            _sse("message_stop", {"type": "message_stop"})),
                     engine_error=(_sse("error", {"type": "error", "error": {"type": "api_error",
                                                                              "message": "engine died"}}),),
                     client_error=(_sse("error", {"type": "error", "error": {"type": "invalid_request_error",
                                                                              "message": "bad arguments"}}),)),
}
assert set(WIRES) == set(ENDPOINTS), "every endpoint the platform serves is enumerated"

_ERROR_400 = {"error": {"message": "bad request", "type": "BadRequestError", "code": 400}}
_ERROR_500 = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
# Every wait is shorter than a request's deadline (the config says so); a stream of a token every 10 ms is
# never idle.
_SHORT_DEADLINE = {"queue_timeout_s": 0.05, "body_timeout_s": 0.05,
                   "limits": {"request_timeout_s": 0.2, "stream_idle_timeout_s": 0.18}}


def _started(w: Wire) -> list[Any]:
    return [Accepted("replica-1"), ReplyHead(200, None, True), *w.prelude]


@dataclass(frozen=True)
class Way:
    """One way a request ends: what the replica answers (`script`, from the endpoint's wire), what the
    client does (`client`: read it all, hang up after the first chunk, leave while the replica works, or
    leave before its stream's response started), and what is expected."""

    name: str
    streamed: bool | None  # None: both, whole and streamed
    script: Callable[[Wire], list[Any]]
    ending: Ending | None  # None: refused at the door, before the request had a RequestEnd
    status: int | str
    client: str = "read"  # read | hang_up | leave | never_start
    setup: str = ""  # unknown_model | queue_full | gateway_bug
    gateway: dict[str, Any] | None = None  # the gateway's config for this way
    rollout: tuple[bool, ...] = ()  # what the rollout hook records for the version
    version_failed: bool = False  # the version could not take it (recorded before any reply)
    # A started stream's last event: its error (code, HTTP status, words its message says).
    error_event: tuple[str, int, str] | None = None
    usage: tuple[int, int] | str | None = None  # what the request is charged ("wire": the wire's usage); None: unchecked


_BEFORE_ANY_REPLY = [
    Way("refused_at_the_door", None, lambda w: [], None, 404, setup="unknown_model"),
    Way("refused_queue_full", None, lambda w: [], Ending.REFUSED, 429, setup="queue_full"),
    Way("refused_no_replica", None, lambda w: [RuntimeError("no replica")], Ending.REFUSED, 503,
        version_failed=True),
    Way("timed_out_before_the_first_byte", None, lambda w: [Accepted("replica-1"), HANG], Ending.TIMED_OUT, 504,
        gateway=_SHORT_DEADLINE),
    Way("client_gone_before_the_first_byte", None,
        lambda w: [Accepted("replica-1"), Working(prompt_tokens=35, completion_tokens=12), HANG],
        Ending.CLIENT_GONE, CLIENT_GONE, client="leave", usage=(35, 12)),
    Way("gateway_error", None, lambda w: [], Ending.GATEWAY_ERROR, 500, setup="gateway_bug"),
]
WAYS = _BEFORE_ANY_REPLY + [
    # whole replies
    Way("served", False, lambda w: [Accepted("replica-1"), ReplyHead(200, w.whole)], Ending.SERVED, 200,
        rollout=(True,), usage="wire"),
    Way("replica_said_no", False, lambda w: [Accepted("replica-1"), ReplyHead(400, _ERROR_400)], Ending.SERVED, 400),
    Way("replica_failed_before_its_reply", False, lambda w: [Accepted("replica-1"), ReplyHead(500, _ERROR_500)],
        Ending.REFUSED, 503, version_failed=True),
    # streams
    Way("served", True, lambda w: [*_started(w), w.token, w.token, *w.final], Ending.SERVED, 200,
        rollout=(True,), usage="wire"),
    Way("replica_failed_before_its_first_chunk", True,
        lambda w: [Accepted("replica-1"), ReplyHead(200, None, True), RuntimeError("actor died")],
        Ending.REFUSED, 503, version_failed=True),
    Way("client_error_in_band", True, lambda w: [*_started(w), w.token, *w.client_error], Ending.SERVED, 200,
        rollout=(True,)),
    Way("engine_error_in_band", True, lambda w: [*_started(w), w.token, *w.engine_error],
        Ending.ENGINE_ERROR, STREAM_ERROR, rollout=(False,)),
    Way("replica_broke_mid_stream", True, lambda w: [*_started(w), w.token, RuntimeError("actor died")],
        Ending.ENGINE_ERROR, STREAM_ERROR, rollout=(False,), error_event=("stream_interrupted", 503, "broke: RuntimeError")),
    Way("client_hung_up", True, lambda w: [*_started(w), w.token, w.token, *w.final],
        Ending.CLIENT_GONE, CLIENT_GONE, client="hang_up"),
    Way("past_the_deadline", True, lambda w: [*_started(w), w.token, SLOW], Ending.TIMED_OUT, STREAM_ERROR,
        gateway=_SHORT_DEADLINE, error_event=("request_timeout", 504, "ran past the request timeout")),
    Way("idle", True, lambda w: [*_started(w), w.token, HANG], Ending.TIMED_OUT, STREAM_ERROR,
        gateway={"limits": {"stream_idle_timeout_s": 0.1}}, error_event=("stream_idle_timeout", 504, "sent nothing for 0.1s")),
    Way("drained", True, lambda w: [Accepted("replica-1"), ReplyHead(200, None, True), DEPART, *w.prelude,
                                    w.token, HANG],
        Ending.DRAINED, STREAM_ERROR, error_event=("replica_drain_timeout", 503, "past the drain timeout")),
    Way("response_never_started", True, lambda w: [*_started(w), w.token, w.token, *w.final],
        Ending.CLIENT_GONE, CLIENT_GONE, client="never_start"),
]


def _cases() -> list[Any]:
    cases = []
    for endpoint in ENDPOINTS.values():
        can_stream = endpoint.generates  # embeddings have no stream
        for way in WAYS:
            for streamed in ((False, True) if way.streamed is None else (way.streamed,)):
                if streamed and not can_stream:
                    continue
                cases.append(pytest.param(endpoint, way, streamed,
                                          id=f"{endpoint.name}-{'stream' if streamed else 'whole'}-{way.name}"))
    return cases


@pytest.fixture(scope="module", autouse=True)
def _vllm_request_models():
    warm_up()  # vLLM's request models, imported once, so no case's timing includes the import


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def _client(body: Any, action: str) -> str:
    """What the client does with a stream's response body; returns what it received."""
    if action == "never_start":
        return ""  # it left before the response started: the body is never iterated
    if action == "hang_up":
        first = await body.__anext__()
        await body.aclose()
        return first
    return "".join([chunk async for chunk in body])


def _last_error(endpoint: Endpoint, text: str) -> tuple[str, Any, str]:
    """A stream's last event, which must be an error in the endpoint's own shape: (the shape, its code
    (Anthropic's: its type), its message)."""
    last = [e for e in text.split("\n\n") if e][-1]
    if not endpoint.wire.typed_events:
        error = json.loads(last.removeprefix("data: "))["error"]
        return "openai", error["code"], error["message"]
    assert last.startswith("event: error\ndata: "), last
    data = json.loads(last.removeprefix("event: error\ndata: "))
    assert data["type"] == "error"
    if "error" in data:
        return "anthropic", data["error"]["type"], data["error"]["message"]
    return "responses", data["code"], data["message"]


@pytest.mark.parametrize(("endpoint", "way", "streamed"), _cases())
def test_every_way_a_request_ends_runs_each_hook_once_with_its_outcome(endpoint: Endpoint, way: Way, streamed: bool):
    wire = WIRES[endpoint.name]
    name = wire.body["model"]
    config = parse_config({"models": [
        # a short drain timeout: the `drained` way's replica leaves mid-stream (a replica that never leaves
        # never runs into it)
        {"name": "m", "source": "builtin:smollm2-135m-instruct", "draining": {"timeout_s": 0.1}},
        {"name": "e", "task": "embed", "source": "builtin:all-minilm-l6-v2"}], "gateway": way.gateway or {}})
    model = config.find_model(name)
    replica = ScriptedReplica(way.script(wire), wire)
    others = {n: Replica() for n in ("m", "e") if n != name}
    forwarder, _, traffic = build_pipeline(config, {name: replica, **others})
    counting = CountingHooks()
    forwarder.hooks = counting.hooks
    body = {**wire.body, **({"stream": True} if streamed else {})}
    if way.setup == "unknown_model":
        body["model"] = "nope"
    gate, capacity = forwarder.state.gate(model), forwarder.state.capacity(model)
    taken = 0
    if way.setup == "queue_full":  # the model's admission bound is reached by requests already admitted
        while gate.try_admit(capacity) is None:
            taken += 1
    if way.setup == "gateway_bug":
        def bug() -> None:
            raise RuntimeError("a bug in the gateway")

        forwarder.traffic.ensure_started = bug  # type: ignore[method-assign]
    got: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The gateway's route: the pipeline's response, and the client reading it (or not)."""
        response = got["response"] = await forwarder.forward(HttpRequest(scope, receive), endpoint)
        if isinstance(response, StreamingResponse):
            got["text"] = await _client(response.body_iterator, way.client)

    async def run() -> None:
        request = _request(body, endpoint.path)
        call = asyncio.ensure_future(SettleUnsettled(app)(request.scope, request.receive, _ignore))
        if way.client == "leave":  # Serve cancels the route when the client's connection closes
            await _until(lambda: replica.hanging)
            call.cancel()
        if way.client == "leave" or way.ending is Ending.GATEWAY_ERROR:
            with pytest.raises(asyncio.CancelledError if way.client == "leave" else RuntimeError):
                await call
        else:
            await call

    asyncio.run(run())
    gate.release(taken)

    # each hook once, for the one RequestEnd, with the expected outcome
    end = counting.end
    if way.ending is None:
        assert end is None and counting.ran == [], "refused at the door: nothing was taken, nothing to settle"
    else:
        assert end is not None
        assert Counter(n for n, _ in counting.ran) == Counter(STANDARD), "every hook ran exactly once"
        outcome = end.ctx.outcome
        assert outcome is not None and (outcome.ending, outcome.status) == (way.ending, way.status)
        assert end.tel._done and (end.ctx.ticket is None or end.ctx.ticket._settled)
        (usage_record,) = counting.records  # one ledger record per settled request, of what its key was charged
        assert usage_record.status == str(outcome.status) and usage_record.request_id == end.ctx.routing_id
        charged = end.ctx.ticket.charged if end.ctx.ticket is not None else (0, 0)
        assert (usage_record.prompt_tokens, usage_record.completion_tokens) == charged
        streams = replica.streams
        assert [s.cancelled for s in streams] == [not outcome.finished] * len(streams), \
            "the replica's work is cancelled unless it finished by itself"
        if way.usage is not None:
            usage = end.ctx.usage
            assert (usage.prompt_tokens, usage.completion_tokens) == (wire.usage if way.usage == "wire" else way.usage)
    assert counting.rollouts == list(way.rollout), "the version's rollout record"
    assert traffic.records == ([("default", False)] if way.version_failed else [])

    # what the client got
    response = got.get("response")
    if way.ending is Ending.GATEWAY_ERROR or way.client == "leave":
        assert response is None, "no response: the route raised (a 500 from the app's handler) or was cancelled"
    elif way.status == STREAM_ERROR or (streamed and way.ending in (Ending.SERVED, Ending.CLIENT_GONE)):
        assert isinstance(response, StreamingResponse) and response.status_code == 200
    else:
        assert response is not None and response.status_code == way.status
        reply = json.loads(bytes(response.body))
        if way.status >= 400:  # type: ignore[operator]
            envelope = reply["type"] == "error" and "type" in reply["error"] if endpoint is MESSAGES \
                else "code" in reply["error"]
            assert envelope, f"the endpoint's own error envelope: {reply}"
    text = got.get("text", "")
    if way.error_event is not None:
        code, status, words = way.error_event
        shape, found, message = _last_error(endpoint, text)
        assert shape == {"messages": "anthropic", "responses": "responses"}.get(endpoint.name, "openai")
        assert found == (anthropic_error({}, status)["error"]["type"] if shape == "anthropic" else code)
        assert words in message
    if streamed and way.name == "served":
        if endpoint.wire.typed_events:
            assert text == "".join([*wire.prelude, wire.token, wire.token, *wire.final]), "events pass as sent"
        else:
            assert text == wire.token * 2 + "data: [DONE]\n\n", \
                "the engine's bytes, less the usage chunk the client did not ask for (the replica drops it)"
    if way.name.endswith("in_band"):
        assert text.endswith("".join(wire.engine_error if way.ending is Ending.ENGINE_ERROR else wire.client_error))

    # everything given back
    assert gate.admitted == 0, "the admission slots are back"
    assert forwarder.state.dispatch(model).dispatched == 0, "the dispatch turn is back"
    assert replica.routing.load("replica-1") == 0, "the routers' in-flight count"
    assert forwarder.state.drains(model).open == {}, "no stream left counted open on the replica"
    assert forwarder.calls.channels is None or forwarder.calls.channels._inboxes == {}, "no token-channel inbox"
