"""The gateway's per-request telemetry without Ray: spans into OpenTelemetry's in-memory exporter, the
usage chunk the gateway asked for, and the timing of token chunks."""

from __future__ import annotations

import asyncio
import json

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shunter import tracing
from shunter.deployments.replica_telemetry import traced
from shunter.deployments.telemetry import RequestTelemetry, ask_for_usage
from shunter.replica_protocol import Working

EXPORTER = InMemorySpanExporter()


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


# vLLM's own layout (pydantic's compact JSON, `usage` last), read without decoding the event, and a spaced
# layout, which takes the decoding path: both must give the same counts and the same events.
LAYOUTS = {"vllm": {"separators": (",", ":"), "ensure_ascii": False}, "spaced": {}}


@pytest.fixture(params=sorted(LAYOUTS))
def dumps(request):
    return lambda obj: json.dumps(obj, **LAYOUTS[request.param])


def _event(dumps, obj) -> str:
    return "data: " + dumps(obj) + "\n\n"


def _chunk(dumps, content: str) -> str:
    return _event(dumps, {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
                          "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]})


def _usage(dumps) -> str:
    return _event(dumps, {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})


def test_a_stream_always_asks_the_engine_for_running_usage_without_changing_the_clients_body():
    body = {"stream": True, "stream_options": {"continuous_usage_stats": False}}
    sent = ask_for_usage(body)
    assert sent["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert body["stream_options"] == {"continuous_usage_stats": False}, "the client's body is not changed"
    assert ask_for_usage({"stream": False}) == {"stream": False}


def _running(dumps, content: str, index: int, completion: int, prompt: int = 7) -> str:
    return _event(dumps, {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                          "choices": [{"index": index, "delta": {"content": content}, "finish_reason": None}],
                          "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                    "total_tokens": prompt + completion, "prompt_tokens_details": None}})


@pytest.mark.parametrize("client_asked", [False, True])
def test_running_usage_counts_the_tokens_so_far_and_reaches_only_a_client_that_asked(client_asked, dumps):
    tel = RequestTelemetry("m", "chat", {}, "req-1", client_wants_usage=True, continuous_usage=client_asked)
    tel.choices_per_prompt = 2
    sent = [_running(dumps, "a", 0, 1), _running(dumps, "b", 1, 1), _running(dumps, "c\"}, \"usage\": {", 0, 2)]
    relayed = [tel.chunk(c) for c in sent]
    events = [json.loads(r[len("data: "):]) for r in relayed]
    assert [("usage" in e) for e in events] == [client_asked] * 3
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["a", "b", 'c"}, "usage": {']
    assert all(r.endswith("}\n\n") for r in relayed)
    if client_asked:
        assert relayed == sent, "the engine's bytes pass through"
    # cut here (the client hung up): two choices, 2 + 1 tokens so far, one prompt of 7
    assert (tel.prompt_tokens, tel.completion_tokens) == (7, 3)


def test_a_batch_counts_each_prompt_once(dumps):
    tel = RequestTelemetry("m", "completion", {}, "req-1")
    tel.choices_per_prompt = 2  # choices 0, 1 answer prompt 0; 2, 3 prompt 1
    for index, prompt in [(0, 5), (1, 5), (2, 9), (3, 9), (3, 9)]:
        tel.chunk(_running(dumps, "x", index, 1, prompt))
    assert (tel.prompt_tokens, tel.completion_tokens) == (14, 4)
    tel.choices_per_prompt = 20
    tel.chunk(_running(dumps, "x", 13, 2, 9))  # a two-digit index
    assert tel._completion_by_choice[13] == 2


def test_an_error_event_inside_a_stream_is_noted_for_the_relay(dumps):
    tel = RequestTelemetry("m", "chat", {}, "req-1")
    error = {"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}}
    assert tel.chunk(_event(dumps, error))
    assert tel.in_band_error == error["error"]


@pytest.mark.parametrize("client_asked", [False, True])
def test_the_usage_chunk_counts_tokens_and_reaches_only_a_client_that_asked(client_asked, dumps):
    tel = RequestTelemetry("m", "chat", {}, "req-1", client_wants_usage=client_asked)
    relayed = [tel.chunk(c) for c in (_chunk(dumps, "a"), _chunk(dumps, "b"), _usage(dumps), "data: [DONE]\n\n")]
    assert relayed[:2] == [_chunk(dumps, "a"), _chunk(dumps, "b")] and relayed[3] == "data: [DONE]\n\n"
    assert (relayed[2] is not None) == client_asked
    assert (tel.prompt_tokens, tel.completion_tokens) == (7, 3)
    assert tel.streamed and len(tel._itl) == 1, "one gap between the two token chunks"
    tel.finish(200)
    (span,) = EXPORTER.get_finished_spans()
    assert span.attributes["gen_ai.usage.output_tokens"] == 3 and span.attributes["shunter.request_id"] == "req-1"
    assert [e.name for e in span.events] == ["first_token"]


def test_a_request_is_one_trace_continuing_the_clients_traceparent():
    trace_id, parent = "0af7651916cd43dd8448eb211cac4b16", "b7ad6b7169203331"
    tel = RequestTelemetry("m", "chat", {"traceparent": f"00-{trace_id}-{parent}-01"}, "req-2")
    carrier = tel.routing("v1", attempt=1)
    tel.attempt_failed("ReplicaFailure")
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
    assert carrier["traceparent"].split("-")[1:3] == [trace_id, format(second.context.span_id, "016x")], \
        "the replica gets the context of the routing span that reached it"


def test_the_replica_span_continues_the_carrier_and_marks_the_first_token():
    with tracing.tracer().start_as_current_span("gateway") as gateway:
        carrier = tracing.inject()

    async def reply():
        for item in ("accepted", {"status": 200, "stream": True}, _chunk(json.dumps, "x"), _chunk(json.dumps, "y")):
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
    tel = RequestTelemetry("m", "completion", {}, "req-3")
    tel.finish(503)
    tel.finish(200)  # a second end (a stream's relay closing late) changes nothing
    (span,) = EXPORTER.get_finished_spans()
    assert not span.status.is_ok and span.attributes["http.response.status_code"] == "503"


def test_spans_never_carry_the_key_or_the_prompt_by_default_and_the_end_callbacks_see_the_usage():
    key = "sk-secret-0123456789abcdef"
    headers = {"authorization": f"Bearer {key}", "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    tel = RequestTelemetry("m", "chat", headers, "req-9")
    seen = []
    tel.on_finish.append(lambda status, prompt, completion: seen.append((status, prompt, completion)))
    tel.routing("v1", attempt=1)
    tel.accepted("replica-1")
    tel.chunk(_chunk(json.dumps, "secret prompt echo"))
    tel.chunk(_usage(json.dumps))
    tel.finish(200)
    tel.finish(200)  # once only
    assert seen == [("200", 7, 3)]
    text = json.dumps([{**dict(s.attributes or {}), "events": [e.name for e in s.events]}
                       for s in EXPORTER.get_finished_spans()])
    assert key not in text and "authorization" not in text.lower() and "secret prompt" not in text


def test_a_client_that_left_is_counted_at_the_larger_of_what_was_relayed_and_what_the_replica_reported(dumps):
    whole = RequestTelemetry("m", "chat", {}, "req-10")
    whole.working(Working(prompt_tokens=35, completion_tokens=12))
    assert (whole.prompt_tokens, whole.completion_tokens) == (0, 0), "counted only once the client has left"
    whole.client_left()
    assert (whole.prompt_tokens, whole.completion_tokens) == (35, 12)
    stream = RequestTelemetry("m", "chat", {}, "req-11")
    stream.chunk(_event(dumps, {"choices": [{"index": 0, "delta": {"content": "a"}}],
                                "usage": {"prompt_tokens": 7, "completion_tokens": 3}}))
    stream.client_left()  # a stream has no heartbeat: its chunks' running usage stands
    assert (stream.prompt_tokens, stream.completion_tokens) == (7, 3)
