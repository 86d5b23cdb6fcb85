"""The gateway's per-request telemetry without Ray: spans into OpenTelemetry's in-memory exporter, and
the timing of the token chunks the stream account tells it of (the engine's texts through the replica's
StreamReader, as a replica sends them). (What the replica reads of a stream is
tests/unit/test_stream_reader.py's; what the gateway keeps of it, tests/unit/test_stream_account.py's.)"""

from __future__ import annotations

import asyncio
import json

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shunter import tracing
from shunter.config import parse_config
from shunter.deployments.gateway.context import RequestContext, served
from shunter.deployments.gateway.request_end import RequestEnd, standard_hooks
from shunter.deployments.gateway.stream_account import StreamAccount
from shunter.deployments.gateway.telemetry import RequestTelemetry
from shunter.deployments.replica.telemetry import traced
from shunter.endpoints import CHAT, COMPLETION, Endpoint, ParsedRequest
from shunter.replica_protocol import AdapterRoute, ReplyHead, StreamChunk
from shunter.wire_formats import OPENAI_CHUNKS
from tests.unit.test_forward import EngineStream

pytestmark = pytest.mark.unit

EXPORTER = InMemorySpanExporter()
MODEL = parse_config({"models": [{"name": "m", "source": "builtin:smollm2-135m-instruct"}]}).models[0]


@pytest.fixture(scope="module", autouse=True)
def provider():
    """The process-wide provider (OpenTelemetry lets a process set it once) with our exporter on it,
    whichever test set it first: these tests pass in any order and beside any other."""
    processor = SimpleSpanProcessor(EXPORTER)
    current = trace.get_tracer_provider()
    if not isinstance(current, TracerProvider):
        current = TracerProvider()
        trace.set_tracer_provider(current)
    current.add_span_processor(processor)
    yield
    processor.shutdown()


@pytest.fixture(autouse=True)
def clean():
    EXPORTER.clear()


def _ctx(endpoint: Endpoint = CHAT, request_id: str = "req-1", **parsed) -> RequestContext:
    return RequestContext(endpoint, ParsedRequest(endpoint, {}, **parsed), MODEL, request_id)


def _chunk(content: str) -> str:
    return "data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
                                  "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]},
                                 separators=(",", ":")) + "\n\n"


class Rollouts:
    """Where the rollout hook records the version's outcomes (LiveVersions' interface)."""

    def record_request(self, *outcome: object) -> None: ...


USAGE = 'data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n'


def _replica_sends(texts: list[str]) -> list:
    """What a replica sends the gateway for an engine stream of `texts` (prompt 7, a token per content
    chunk): its chunks, then its end."""
    return EngineStream(OPENAI_CHUNKS, prompt=7).all(texts)


def test_token_chunks_time_the_first_token_and_the_gaps_and_the_span_carries_the_usage():
    ctx = _ctx(stream=True)
    tel = RequestTelemetry(ctx, {})
    account = StreamAccount(ctx.usage, tel.token)
    role = 'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
    relayed = [account.take(c) for c in _replica_sends([role, _chunk("a"), _chunk("b"), USAGE, "data: [DONE]\n\n"])]
    assert relayed == [role, _chunk("a"), _chunk("b"), "data: [DONE]\n\n", None]
    assert tel.streamed and len(tel._itl) == 1, "one gap between the two token chunks, the role chunk no token"
    assert tel.first_token_at is not None and tel.first_token_at >= ctx.began
    tel.finish(200)
    (span,) = EXPORTER.get_finished_spans()
    assert span.attributes["gen_ai.usage.output_tokens"] == 3 and span.attributes["gen_ai.usage.input_tokens"] == 7
    assert span.attributes["shunter.request_id"] == "req-1" and span.attributes["http.route"] == "/v1/chat/completions"
    assert [e.name for e in span.events] == ["first_token"]


def test_a_whole_reply_is_its_own_first_token_and_times_no_gaps():
    tel = RequestTelemetry(_ctx(), {})
    tel.whole_reply()
    assert tel.first_token_at is not None and not tel.streamed and tel._itl == []


def test_a_request_is_one_trace_continuing_the_clients_traceparent():
    trace_id, parent = "0af7651916cd43dd8448eb211cac4b16", "b7ad6b7169203331"
    ctx = _ctx(request_id="req-2")
    tel = RequestTelemetry(ctx, {"traceparent": f"00-{trace_id}-{parent}-01"})
    ctx.version = "v1"  # the version an attempt goes to (shunter.deployments.gateway.replica_call)
    carrier = tel.routing("v1", attempt=1)
    tel.attempt_failed("ReplicaFailure")
    ctx.version = "v2"
    carrier = tel.routing("v2", attempt=1)  # the version fallback: a second routing span
    tel.accepted("replica-a")
    tel.answered()
    tel.finish(200)
    spans = {(s.name, s.attributes.get("shunter.version")): s for s in EXPORTER.get_finished_spans()}
    server = spans[("chat m", "v2")]
    assert format(server.context.trace_id, "032x") == trace_id and format(server.parent.span_id, "016x") == parent
    first, second = spans[("route", "v1")], spans[("route", "v2")]
    assert first.parent.span_id == server.context.span_id == second.parent.span_id
    assert not first.status.is_ok and second.attributes["shunter.replica"] == "replica-a"
    assert server.attributes["shunter.replica"] == "replica-a"
    assert carrier["traceparent"].split("-")[1:3] == [trace_id, format(second.context.span_id, "016x")], \
        "the replica gets the context of the routing span that reached it"


def test_the_replica_span_continues_the_carrier_and_marks_the_first_token():
    with tracing.tracer().start_as_current_span("gateway") as gateway:
        carrier = tracing.inject()

    async def reply():
        for item in ("accepted", ReplyHead(200, None, True), StreamChunk(_chunk("x"), 3, 1), StreamChunk(_chunk("y"), 3, 2)):
            yield item

    async def relay() -> list:
        return [i async for i in traced(reply(), carrier, "chat", "m", "v1", "r1")]

    items = asyncio.run(relay())
    assert len(items) == 4
    spans = {s.name: s for s in EXPORTER.get_finished_spans()}
    replica, engine = spans["replica chat"], spans["engine.generate"]
    assert replica.parent.span_id == gateway.get_span_context().span_id
    assert engine.parent.span_id == replica.context.span_id
    assert [e.name for e in engine.events] == ["first_token"] and engine.attributes["shunter.chunks"] == 2


def test_a_failed_request_ends_its_span_as_an_error_once():
    tel = RequestTelemetry(_ctx(COMPLETION, "req-3"), {})
    tel.finish(503)
    tel.finish(200)  # a second end (a stream's relay closing late) changes nothing
    (span,) = EXPORTER.get_finished_spans()
    assert not span.status.is_ok and span.attributes["http.response.status_code"] == "503"
    assert span.name == "text_completion m" and span.attributes["http.route"] == "/v1/completions"


def test_spans_never_carry_the_key_or_the_prompt_by_default_and_the_outcome_callbacks_see_the_usage():
    """The tier's callbacks are the context's `on_outcome`, run once by RequestEnd.settle after the
    platform's hooks (the telemetry's among them)."""
    key = "sk-secret-0123456789abcdef"
    headers = {"authorization": f"Bearer {key}", "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    ctx = _ctx(request_id="req-9", stream=True)
    tel = RequestTelemetry(ctx, headers)
    end = RequestEnd(ctx, tel, standard_hooks(Rollouts()))
    seen = []
    ctx.on_outcome.append(lambda c: seen.append((c.outcome.status, c.usage.prompt_tokens, c.usage.completion_tokens)))
    tel.routing("default", attempt=1)
    tel.accepted("replica-1")
    account = StreamAccount(ctx.usage, tel.token)
    for item in _replica_sends([_chunk("secret prompt echo"), USAGE]):
        account.take(item)
    end.settle(served(200))
    end.settle(served(200))  # once only
    assert seen == [(200, 7, 3)] and tel._done
    text = json.dumps([{**dict(s.attributes or {}), "events": [e.name for e in s.events]}
                       for s in EXPORTER.get_finished_spans()])
    assert key not in text and "authorization" not in text.lower() and "secret prompt" not in text


def test_the_prompt_reaches_the_span_only_when_logged_and_an_adapter_names_the_request():
    ctx = _ctx(request_id="req-12")
    ctx.adapter = AdapterRoute("sql", "/adapters/sql", "sql@abc", version="abc")
    tel = RequestTelemetry(ctx, {}, log_prompt="what is 2+2?", label="tier_monitor")
    assert tel.endpoint == "tier_monitor", "the metrics' endpoint label"
    tel.finish(200)
    (span,) = EXPORTER.get_finished_spans()
    assert span.attributes["shunter.prompt"] == "what is 2+2?"
    assert (span.attributes["shunter.adapter"], span.attributes["gen_ai.request.model"],
            span.attributes["shunter.adapter_version"]) == ("sql", "sql", "abc")


class _Recorded:
    """Stands in for the built metrics: every set, observe and inc, by metric name."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float, dict[str, str]]] = []

    def __getitem__(self, name: str) -> object:
        recorded = self

        class Metric:
            def set(self, value: float, tags: dict[str, str]) -> None:
                recorded.calls.append((name, "set", value, tags))

            def observe(self, value: float, tags: dict[str, str]) -> None:
                recorded.calls.append((name, "observe", value, tags))

            def inc(self, value: float, tags: dict[str, str]) -> None:
                recorded.calls.append((name, "inc", value, tags))

        return Metric()

    def of(self, name: str) -> list[tuple[str, float, dict[str, str]]]:
        return [(kind, value, tags) for n, kind, value, tags in self.calls if n == name]


def test_the_flow_queue_is_measured_by_class_and_tenant_and_a_request_that_never_got_its_turn_says_why(monkeypatch):
    from shunter.auth import Caller
    from shunter.deployments.gateway import telemetry

    recorded = _Recorded()
    monkeypatch.setattr(telemetry, "_record", lambda fn: fn(recorded))
    tags = {"model": "m", "priority_class": "batch", "key_name": "team-a"}

    def waiting() -> RequestTelemetry:
        ctx = _ctx()
        ctx.priority_class, ctx.caller = "batch", Caller(name="team-a", key_id="abc", config=None)
        tel = RequestTelemetry(ctx, {})
        tel.admitted()
        return tel

    served_one, left, timed_out = waiting(), waiting(), waiting()
    assert recorded.of("shunter_flow_queued")[-1] == ("set", 3, tags)
    served_one.turn()
    served_one.finish(200)
    left.finish(499)
    timed_out.refused("queue_timeout")
    timed_out.finish(503)
    assert recorded.of("shunter_flow_queued")[-1] == ("set", 0, tags)
    (wait,) = recorded.of("shunter_flow_wait_seconds")
    assert wait[0] == "observe" and wait[2] == tags
    refusals = [t["reason"] for _, _, t in recorded.of("shunter_flow_refusals_total")]
    assert refusals == ["client_left", "queue_timeout"], "each once; the served one is no refusal"
