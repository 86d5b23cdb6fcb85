"""The forward pipeline, whole replies and streams, end to end in one process: the real Forwarder, door,
body reader, serving state, relay and RequestEnd, in front of a stand-in replica (a recording handle whose
stream speaks the replica protocol: its engine's SSE texts through the replica's real StreamReader,
`EngineStream`) and a recording traffic record. What is checked is what each ending
leaves behind: the version's outcome for rollouts, the admission slot, the routers' in-flight count; and
that a refusal is the endpoint's own response, in its API's error envelope. (Every ending, for every
endpoint, is enumerated in tests/unit/test_request_end.py.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.requests import Request

from shunter.config import parse_config
from shunter.deployments.gateway.access import AccessControl, Ticket
from shunter.deployments.gateway.context import Ending
from shunter.deployments.gateway.flow.priority import PRIORITY_HEADER
from shunter.deployments.gateway.forward import Forwarder
from shunter.deployments.gateway.lora import LiveAdapters
from shunter.deployments.gateway.request_body import BodyReader
from shunter.deployments.gateway.request_end import RequestEnd
from shunter.deployments.gateway.serving_state import ServingState
from shunter.deployments.replica.stream_reader import StreamReader, engine_stream_body
from shunter.endpoints import CHAT, ENDPOINTS, MESSAGES, Endpoint
from shunter.replica_protocol import Accepted, EngineLoad, ReplyHead, StreamChunk, StreamEnd, Working
from shunter.wire_formats import WireFormat


async def until(condition: Any, timeout_s: float = 10.0) -> None:
    """Let the other tasks run until `condition()` holds (their progress, not a span of time, is what the
    next step needs); fails after `timeout_s`."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not condition():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.001)

pytestmark = pytest.mark.unit

CONFIG = parse_config({"models": [{"name": "m", "source": "builtin:smollm2-135m-instruct"}]})
MODEL = CONFIG.models[0]
TOKEN = 'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = 'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
DONE = "data: [DONE]\n\n"


class EngineStream:
    """What a replica makes of its engine's stream (shunter.deployments.replica.model_server): each SSE text
    through the replica's real StreamReader, beside the engine's running count, then the reader's
    StreamEnd. The count stands in for the engine's per-request state: `prompt` tokens from the start and
    one completion token more with each text that carries one (content in a choice, a typed delta);
    `counted=False`: an engine that cannot say (the final usage alone counts)."""

    def __init__(self, wire: WireFormat, prompt: int = 3, usage_chunk_wanted: bool = False, counted: bool = True):
        self.wire, self.prompt, self.completion = wire, prompt, 0
        self.reader = StreamReader(wire, self.counts if counted else None, usage_chunk_wanted)

    @classmethod
    def of(cls, request: Any, prompt: int = 3, counted: bool = True) -> EngineStream:
        """For a request as the replica gets it: the client's own `include_usage` decides whether the final
        usage chunk (which the replica always has the engine send) reaches the client."""
        wire = ENDPOINTS[request.endpoint].wire
        return cls(wire, prompt, engine_stream_body(request.body, wire)[1], counted)

    def counts(self) -> tuple[int, int]:
        return self.prompt, self.completion

    def chunk(self, text: str) -> StreamChunk | None:
        """The engine produced `text`: what the replica yields for it (None: dropped)."""
        if self._is_token(text):
            self.completion += 1
        return self.reader.chunk(text)

    def end(self) -> StreamEnd:
        return self.reader.end()

    def all(self, texts: list[str]) -> list[StreamChunk | StreamEnd]:
        """A whole stream of `texts`, as the replica yields it: its chunks, then its end."""
        return [c for c in map(self.chunk, texts) if c is not None] + [self.end()]

    def _is_token(self, text: str) -> bool:
        if self.wire.typed_events:
            return self.wire.read_event(text).token
        try:
            data = json.loads(text.removeprefix("data: "))
        except ValueError:
            return False
        choices = data.get("choices") if isinstance(data, dict) else None
        return any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices or [])


class ReplicaStream:
    """A replica's answer: `items` in order (an exception instance is raised where it stands), then its end."""

    def __init__(self, items: list[Any]):
        self.items, self.cancelled = items, False

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> Any:
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class Replica:
    """A handle whose calls answer like a ModelServer replica (Accepted, the head, then a stream's chunks
    and its end), and that tells the routing state where it sent each request, as Shunter's router does."""

    deployment_name, app_name = "model-m", "forward-test"

    def __init__(self, load: EngineLoad | None = None) -> None:
        self.routing: Any = None
        self.load = load  # what its engine reports with each Accepted

    def options(self, **_: Any) -> Replica:
        return self

    @property
    def handle(self) -> Replica:
        return self

    def remote(self, request: Any) -> ReplicaStream:
        self.routing.dispatched("replica-1", request.request_id)
        head = ReplyHead(200, None, True) if request.body.get("stream") is True else \
            ReplyHead(200, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
        rest = EngineStream.of(request).all([TOKEN, USAGE, DONE]) if head.stream else []
        return ReplicaStream([Accepted("replica-1", None, self.load), head, *rest])


class Traffic:
    def __init__(self) -> None:
        self.records: list[tuple[str, bool]] = []

    def ensure_started(self) -> None: ...

    def serving(self, model: Any) -> list[str]:
        return ["default"]

    def record_request(self, model: Any, adapter: Any, version: str, ok: bool, ttft_s: Any, e2e_s: Any) -> None:
        self.records.append((version, ok))


def _request(body: dict[str, Any], path: str = "/v1/chat/completions",
             headers: dict[str, str] | None = None) -> Request:
    raw = json.dumps(body).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                         *((k.encode(), v.encode()) for k, v in (headers or {}).items())]}
    return Request(scope, receive)


@pytest.fixture
def pipeline() -> tuple[Forwarder, Replica, Traffic]:
    return build_pipeline()


def build_pipeline(config: Any = CONFIG, replicas: dict[str, Replica] | None = None) \
        -> tuple[Forwarder, Replica, Traffic]:
    """The real Forwarder in front of stand-in replicas (`replicas`: model name -> its one replica, the
    first one returned; by default model `m`'s `Replica`)."""
    replicas = replicas or {"m": Replica()}
    traffic = Traffic()
    state = ServingState(config, {name: {"default": r} for name, r in replicas.items()}, traffic)  # type: ignore[arg-type]
    forwarder = Forwarder(config, AccessControl(config), BodyReader(config.gateway), state,
                          traffic, None, LiveAdapters(config))  # type: ignore[arg-type]
    for name, replica in replicas.items():
        replica.routing = state.routing(config.find_model(name), "default")
    return forwarder, next(iter(replicas.values())), traffic


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}


def test_a_whole_reply_records_the_versions_success_and_gives_everything_back(pipeline):
    forwarder, replica, traffic = pipeline
    response = asyncio.run(forwarder.forward(_request(_body()), CHAT))
    assert response.status_code == 200 and response.headers["x-shunter-replica"] == "replica-1"
    assert traffic.records == [("default", True)], "a whole reply counts for the version's gates"
    assert forwarder.state.gate(MODEL).admitted == 0 and replica.routing.load("replica-1") == 0


def test_a_stream_records_the_versions_success_when_its_relay_ends(pipeline):
    forwarder, replica, traffic = pipeline

    async def run() -> str:
        response = await forwarder.forward(_request(_body(stream=True)), CHAT)
        return "".join([chunk async for chunk in response.body_iterator])

    text = asyncio.run(run())
    assert text == TOKEN + DONE, "the replica's bytes, without the usage chunk the client did not ask for"
    assert traffic.records == [("default", True)]
    assert forwarder.state.gate(MODEL).admitted == 0 and replica.routing.load("replica-1") == 0


def test_a_streams_usage_chunk_reaches_the_client_that_asked_for_it(pipeline):
    """The client's `stream_options` reach the replica unchanged, and the replica's reader keeps the
    usage chunk for the client that asked for it."""
    forwarder, _, _ = pipeline

    async def run() -> str:
        response = await forwarder.forward(_request(_body(stream=True, stream_options={"include_usage": True})), CHAT)
        return "".join([chunk async for chunk in response.body_iterator])

    assert asyncio.run(run()) == TOKEN + USAGE + DONE


class LongReplica(Replica):
    """A replica computing a whole reply: it took the request and reported its progress, and is still at it."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[ReplicaStream] = []

    def remote(self, request: Any) -> ReplicaStream:
        self.routing.dispatched("replica-1", request.request_id)
        stream = _Computing([Accepted("replica-1"), Working(prompt_tokens=35, completion_tokens=12)])
        self.streams.append(stream)
        return stream


class _Computing(ReplicaStream):
    async def __anext__(self) -> Any:
        if not self.items:
            await asyncio.sleep(3600)
        return self.items.pop(0)


def test_a_client_that_leaves_a_whole_reply_stops_the_replica_and_is_charged_what_it_had_produced(monkeypatch):
    """Serve cancels the route's task when the client's connection closes: the replica's call is cancelled
    (its engine requests aborted), the admission slot and the routers' count are given back, nothing is
    recorded for the version, and the key is charged the replica's last report as a 499."""
    replica, traffic = LongReplica(), Traffic()
    state = ServingState(CONFIG, {"m": {"default": replica}}, traffic)  # type: ignore[arg-type]
    forwarder = Forwarder(CONFIG, AccessControl(CONFIG), BodyReader(CONFIG.gateway), state,
                          traffic, None, LiveAdapters(CONFIG))  # type: ignore[arg-type]
    replica.routing = state.routing(MODEL, "default")
    settled: list[tuple[str, int, int]] = []
    monkeypatch.setattr(Ticket, "settle", lambda self, status, prompt, completion, reached_engine:
                        settled.append((str(status), prompt, completion)) if reached_engine else None)

    async def run() -> None:
        task = asyncio.ensure_future(forwarder.forward(_request(_body()), CHAT))
        # Taken, and its progress read (the replica's stream waits for its next item): being computed.
        await until(lambda: replica.streams and not replica.streams[0].items)
        assert replica.routing.load("replica-1") == 1 and forwarder.state.gate(MODEL).admitted == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert [s.cancelled for s in replica.streams] == [True], "the replica's call is cancelled"
    assert settled == [("499", 35, 12)]
    assert forwarder.state.gate(MODEL).admitted == 0 and replica.routing.load("replica-1") == 0
    assert traffic.records == [], "a client leaving says nothing about the version"


class UnavailableReplica(Replica):
    """A replica whose call fails before it takes the request (no replica running, deployment failed)."""

    def remote(self, request: Any) -> ReplicaStream:
        self.routing.dispatched("replica-1", request.request_id)
        return ReplicaStream([RuntimeError("no replica")])


def _messages_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}], **extra}


@pytest.mark.parametrize(("endpoint", "body"), [(CHAT, _body), (MESSAGES, _messages_body)])
def test_a_refusal_is_returned_in_the_endpoints_envelope_and_holds_nothing(endpoint: Endpoint, body):
    """Refusals are responses, not exceptions: at the door (an unknown model: 404, before any RequestEnd
    exists) and after it (no replica could take the request: 503, settled and counted against the version)."""
    forwarder, replica, traffic = build_pipeline(replicas={"m": UnavailableReplica()})
    unknown = asyncio.run(forwarder.forward(_request(body(model="nope"), endpoint.path), endpoint))
    unavailable = asyncio.run(forwarder.forward(_request(body(), endpoint.path), endpoint))
    for response, status, openai_code in ((unknown, 404, "model_not_found"), (unavailable, 503, "model_unavailable")):
        assert response.status_code == status
        error = json.loads(bytes(response.body))
        if endpoint is MESSAGES:  # Anthropic's envelope
            assert error["type"] == "error" and error["error"]["type"] == \
                {404: "not_found_error", 503: "overloaded_error"}[status]
        else:
            assert error["error"]["code"] == openai_code
    assert unavailable.headers["retry-after"] == "5"
    assert traffic.records == [("default", False)], "the version could not take it"
    assert forwarder.state.gate(MODEL).admitted == 0 and forwarder.state.dispatch(MODEL).dispatched == 0
    assert replica.routing.load("replica-1") == 0


def test_a_client_that_leaves_while_its_request_waits_for_a_slot_frees_the_place_and_is_charged_nothing(monkeypatch):
    config = parse_config({"models": [{"name": "m", "source": "builtin:smollm2-135m-instruct",
                                       "max_ongoing_requests": 1}]})
    replica = LongReplica()
    forwarder, _, _ = build_pipeline(config, {"m": replica})
    model = config.models[0]
    settled: list[tuple[str, bool]] = []
    monkeypatch.setattr(Ticket, "settle", lambda self, status, prompt, completion, reached_engine:
                        settled.append((str(status), reached_engine)))

    async def run() -> None:
        queue = forwarder.state.dispatch(model)
        running = asyncio.ensure_future(forwarder.forward(_request(_body()), CHAT))
        await until(lambda: replica.streams)
        waiting = asyncio.ensure_future(forwarder.forward(_request(_body()), CHAT))
        await until(lambda: queue.depth == 1)
        assert queue.dispatched == 1 and queue.depth == 1 and forwarder.state.gate(model).admitted == 2
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert queue.depth == 0 and forwarder.state.gate(model).admitted == 1, "its place is free"
        assert settled == [("499", False)], "settled once, as never having reached an engine"
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    asyncio.run(run())
    assert settled == [("499", False), ("499", True)]
    assert len(replica.streams) == 1, "the one that left while waiting never reached the replica"


class RecordingReplica(Replica):
    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict[str, Any]] = []

    def remote(self, request: Any) -> ReplicaStream:
        self.bodies.append(request.body)
        return super().remote(request)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_engine_gets_the_priority_of_the_requests_class_when_it_schedules_by_priority(policy):
    config = parse_config({"models": [{"name": "m", "source": "builtin:smollm2-135m-instruct",
                                       "engine": {"scheduling_policy": policy}}]})
    replica = RecordingReplica()
    forwarder, _, _ = build_pipeline(config, {"m": replica})
    for cls in ("interactive", "batch"):
        response = asyncio.run(forwarder.forward(_request(_body(), headers={"x-shunter-priority": cls}), CHAT))
        assert response.status_code == 200 and response.headers["x-shunter-priority"] == cls
    expected = [0, 2] if policy == "priority" else [None, None]
    assert [body.get("priority") for body in replica.bodies] == expected
    refused = asyncio.run(forwarder.forward(_request(_body(priority=-5)), CHAT))
    assert refused.status_code == 400 and json.loads(bytes(refused.body))["error"]["code"] == "priority_not_allowed"
    assert len(replica.bodies) == 2, "a client's own engine priority never reaches an engine"
    # Messages (the replica hands it to the chat request vLLM makes of it) and the platform's own requests.
    messages = asyncio.run(forwarder.forward(_request(_messages_body(priority=-5), "/v1/messages",
                                                      headers={"x-shunter-priority": "batch"}), MESSAGES))
    assert messages.status_code == 200, bytes(messages.body)
    asyncio.run(forwarder.ask_internal("m", CHAT, _body()))
    assert [body.get("priority") for body in replica.bodies[2:]] == ([2, 1] if policy == "priority" else [None, None])


def test_a_refused_requests_retry_finds_the_place_its_refusal_kept_and_a_newcomer_does_not_take_it():
    """The same caller sending the same body again is the retry a 429's Retry-After was told to; a
    request arriving meanwhile with another body counts that place as taken."""
    config = parse_config({"models": [{"name": "m", "source": "builtin:smollm2-135m-instruct",
                                       "max_ongoing_requests": 1, "admission": {"max_queued_requests": 2}}]})
    forwarder, _, _ = build_pipeline(config, {"m": LongReplica()})
    model = config.models[0]
    gate, queue = forwarder.state.gate(model), forwarder.state.dispatch(model)
    for _ in range(8):  # a measured finish rate: Retry-After is computed from it, and a place promised
        gate.try_admit(capacity=1)
        gate.release()

    def ask(content: str) -> Any:
        return asyncio.ensure_future(forwarder.forward(_request(_body(messages=[
            {"role": "user", "content": content}])), CHAT))

    async def run() -> None:
        running = ask("running")
        await until(lambda: queue.dispatched == 1)
        first, second = ask("first"), ask("second")
        await until(lambda: queue.depth == 2)
        assert queue.depth == 2 and gate.admitted == 3, "the bound (1 + 2) is full"
        refused = await ask("refused")
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert len(gate.places) == 1
        first.cancel()  # a place in the queue frees; the refused request's kept place is still ahead
        with pytest.raises(asyncio.CancelledError):
            await first
        newcomer = await ask("newcomer")
        assert newcomer.status_code == 429, "the freed place is the refused request's"
        assert len(gate.places) == 2, "the newcomer keeps a place after it"
        retry = ask("refused")
        await until(lambda: retry.done() or queue.depth == 2)
        assert not retry.done() and queue.depth == 2, "admitted beyond the bound on its place: it waits its turn"
        assert len(gate.places) == 1
        for task in (retry, second, running):
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(run())


def test_a_full_models_request_is_refused_before_its_body_is_parsed_and_settled_once(monkeypatch):
    """Issue 39: in a burst the refusals are the many, so a full model's refusal costs no parsing and no
    prompt rendering; it is still a whole refusal: the same 429 and Retry-After, the priority header, the
    flow's refusal count and one settle. A request the door cannot class from its raw JSON goes through
    the whole door, which refuses it the same way after parsing."""
    config = parse_config({"models": [{"name": "m", "source": "builtin:smollm2-135m-instruct",
                                       "max_ongoing_requests": 1, "admission": {"max_queued_requests": 0}}]})
    replica = LongReplica()
    forwarder, _, _ = build_pipeline(config, {"m": replica})
    import shunter.deployments.gateway.forward as forward_module

    parsed: list[str] = []
    real_parse = forward_module.parse

    async def counting_parse(request: Any, endpoint: Any, body: dict[str, Any]) -> Any:
        parsed.append(str(body.get("service_tier")))
        return await real_parse(request, endpoint, body)

    monkeypatch.setattr(forward_module, "parse", counting_parse)
    settled: list[str] = []
    monkeypatch.setattr(Ticket, "settle", lambda self, status, prompt, completion, reached_engine:
                        settled.append(str(status)))
    outcomes: list[Any] = []
    original_settle = RequestEnd.settle
    monkeypatch.setattr(RequestEnd, "settle", lambda self, outcome: (outcomes.append(outcome.ending),
                                                                     original_settle(self, outcome)))

    async def run() -> None:
        running = asyncio.ensure_future(forwarder.forward(_request(_body()), CHAT))
        await until(lambda: replica.streams)  # through the door and on to the replica
        assert parsed == ["None"] and forwarder.state.gate(config.models[0]).admitted == 1
        full = await forwarder.forward(_request(_body()), CHAT)
        assert full.status_code == 429 and full.headers["Retry-After"]
        assert full.headers[PRIORITY_HEADER] == "standard"
        assert json.loads(full.body)["error"]["code"] == "queue_full"
        assert " kept for refused requests' retries" not in json.loads(full.body)["error"]["message"]
        assert parsed == ["None"], "refused before its body was parsed"
        # A place kept for a refused request's retry (here: another caller's, due in 30 s) counts against the
        # bound: the next refusal says so, beside the requests waiting.
        assert forwarder.state.gate(config.models[0]).places.keep(("another caller", "its body"), 0, 1, 30)
        other = await forwarder.forward(_request({**_body(), "max_tokens": 3}), CHAT)
        message = json.loads(other.body)["error"]["message"]
        assert other.status_code == 429 and "0 requests are already waiting" in message, message
        assert "1 place is kept for refused requests' retries" in message, message
        assert outcomes[-1] is Ending.REFUSED, "settled as a refusal"
        assert settled == [], "no quota was reserved, so none is given back"
        # A `service_tier` only the parsed request can read: the whole door refuses it, after parsing.
        odd = await forwarder.forward(_request({**_body(), "service_tier": {"tier": "flex"}}), CHAT)
        assert odd.status_code in (400, 429) and len(parsed) == 2
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    asyncio.run(run())


def test_a_kv_bound_engine_counts_what_it_runs_for_the_headroom_until_its_report_ages(monkeypatch):
    """Issue 52 item 6: an engine that queues requests while it runs fewer than max_num_seqs is bound by its
    KV cache; flow control counts the sequences it really runs, from what the replica reports as it accepts
    each request, and the configured ones again once the report is older than LOAD_FRESH_S."""
    from shunter.deployments.gateway import serving_state

    config = parse_config({"models": [{"name": "m", "source": "builtin:smollm2-135m-instruct",
                                       "engine": {"max_num_seqs": 8}}]})
    model = config.models[0]
    replica = Replica(EngineLoad(running=3, waiting=5, kv_cache_usage=0.98))
    forwarder, _, _ = build_pipeline(config, {"m": replica})
    state = forwarder.state
    now = [1000.0]
    state.clock = lambda: now[0]
    assert state.running_sequences(model) == 8, "no report yet: what the config says"
    assert asyncio.run(forwarder.forward(_request(_body()), CHAT)).status_code == 200
    assert state.running_sequences(model) == 3, "queueing with 3 of 8 running: 3 run at once"
    queue = state.dispatch(model)
    assert queue._limit(2) == 1 and queue._limit(0) == 3, "batch's half of 3, the most urgent class all 3"
    now[0] += serving_state.LOAD_FRESH_S + 1
    assert state.running_sequences(model) == 8, "an old report counts no longer"
    replica.load = EngineLoad(running=8, waiting=20, kv_cache_usage=0.5)  # full batch, queue: not KV-bound
    assert asyncio.run(forwarder.forward(_request(_body()), CHAT)).status_code == 200
    assert state.running_sequences(model) == 8
