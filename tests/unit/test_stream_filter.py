"""The client's stream, filtered (shunter.deployments.gateway.stream_filter): the running usage read from
each chunk into the request's `Usage`, a batch's prompts counted once, an error event inside a 200 stream
noted for the relay, the usage the platform asked for taken back out unless the client asked for it, token
chunks told to the telemetry; and the body the engine gets (`context.engine_body`), which asks for that
usage on every OpenAI-format stream."""

from __future__ import annotations

import json

import pytest

from shunter.deployments.gateway.context import Usage, engine_body
from shunter.deployments.gateway.stream_filter import StreamFilter
from shunter.endpoints import CHAT, COMPLETION, EMBEDDING, MESSAGES, RESPONSES, Endpoint, ParsedRequest
from shunter.replica_protocol import Working

pytestmark = pytest.mark.unit

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


def _running(dumps, content: str, index: int, completion: int, prompt: int = 7) -> str:
    return _event(dumps, {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                          "choices": [{"index": index, "delta": {"content": content}, "finish_reason": None}],
                          "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                    "total_tokens": prompt + completion, "prompt_tokens_details": None}})


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def _filter(endpoint: Endpoint = CHAT, **parsed) -> tuple[StreamFilter, Usage, list[float]]:
    """A stream's filter over its own Usage; the token times it tells the telemetry land in the list."""
    usage, tokens = Usage(), []
    return StreamFilter(ParsedRequest(endpoint, {}, stream=True, **parsed), usage, tokens.append), usage, tokens


# ---- the body the engine gets ----------------------------------------------------------------------------

def test_a_stream_always_asks_the_engine_for_running_usage_without_changing_the_clients_body():
    body = {"model": "alias", "stream": True, "stream_options": {"continuous_usage_stats": False}}
    sent = engine_body(ParsedRequest(CHAT, body, stream=True), "m", None)
    assert sent["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert sent["model"] == "m", "the canonical name the engine knows"
    assert body == {"model": "alias", "stream": True, "stream_options": {"continuous_usage_stats": False}}, \
        "the client's body is not changed"
    whole = {"model": "m", "stream": False}
    assert engine_body(ParsedRequest(CHAT, whole), "m", None) == whole
    completion = engine_body(ParsedRequest(COMPLETION, {"model": "m", "stream": True}, stream=True), "m", None)
    assert completion["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}


@pytest.mark.parametrize("endpoint", [RESPONSES, MESSAGES])
def test_typed_event_streams_have_no_usage_option_to_ask_for(endpoint):
    """Their streams end with the usage; an OpenAI `stream_options` would be a field vLLM refuses."""
    sent = engine_body(ParsedRequest(endpoint, {"model": "m", "stream": True}, stream=True), "m", None)
    assert "stream_options" not in sent


def test_the_tenants_cache_salt_goes_where_the_prompt_reaches_the_prefix_cache():
    assert engine_body(ParsedRequest(CHAT, {"model": "m"}), "m", "salt-1")["cache_salt"] == "salt-1"
    assert "cache_salt" not in engine_body(ParsedRequest(EMBEDDING, {"model": "e"}), "e", "salt-1")
    assert "cache_salt" not in engine_body(ParsedRequest(CHAT, {"model": "m"}), "m", None)


# ---- OpenAI chunks: running usage, batches, errors, the usage chunk ---------------------------------------

@pytest.mark.parametrize("client_asked", [False, True])
def test_running_usage_counts_the_tokens_so_far_and_reaches_only_a_client_that_asked(client_asked, dumps):
    chunks, usage, tokens = _filter(n=2, usage_chunk=True, continuous_usage=client_asked)
    sent = [_running(dumps, "a", 0, 1), _running(dumps, "b", 1, 1), _running(dumps, "c\"}, \"usage\": {", 0, 2)]
    relayed = [chunks.chunk(c) for c in sent]
    events = [json.loads(r[len("data: "):]) for r in relayed]
    assert [("usage" in e) for e in events] == [client_asked] * 3
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["a", "b", 'c"}, "usage": {']
    assert all(r.endswith("}\n\n") for r in relayed)
    if client_asked:
        assert relayed == sent, "the engine's bytes pass through"
    # cut here (the client hung up): two choices, 2 + 1 tokens so far, one prompt of 7
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 3)
    assert len(tokens) == 3, "every token chunk is timed"


def test_a_batch_counts_each_prompt_once(dumps):
    chunks, usage, _ = _filter(COMPLETION, n=2, prompts=2)  # choices 0, 1 answer prompt 0; 2, 3 prompt 1
    for index, prompt in [(0, 5), (1, 5), (2, 9), (3, 9), (3, 9)]:
        chunks.chunk(_running(dumps, "x", index, 1, prompt))
    assert (usage.prompt_tokens, usage.completion_tokens) == (14, 4)
    wide, usage, _ = _filter(COMPLETION, n=20)
    wide.chunk(_running(dumps, "x", 1, 5, 9))
    wide.chunk(_running(dumps, "x", 13, 2, 9))  # a two-digit index: its own choice, not choice 1
    assert (usage.prompt_tokens, usage.completion_tokens) == (9, 7)


def test_an_error_event_inside_a_stream_is_noted_for_the_relay(dumps):
    chunks, _, tokens = _filter()
    error = {"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}}
    assert chunks.chunk(_event(dumps, error)) == _event(dumps, error), "the client sees it"
    assert chunks.in_band_error == error["error"] and tokens == []


@pytest.mark.parametrize("client_asked", [False, True])
def test_the_usage_chunk_counts_tokens_and_reaches_only_a_client_that_asked(client_asked, dumps):
    chunks, usage, tokens = _filter(usage_chunk=client_asked)
    relayed = [chunks.chunk(c) for c in (_chunk(dumps, "a"), _chunk(dumps, "b"), _usage(dumps), "data: [DONE]\n\n")]
    assert relayed[:2] == [_chunk(dumps, "a"), _chunk(dumps, "b")] and relayed[3] == "data: [DONE]\n\n"
    assert (relayed[2] is not None) == client_asked
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 3)
    assert len(tokens) == 2 and tokens[0] <= tokens[1], "the two token chunks are timed, not the usage chunk"


def test_the_usage_chunk_carries_the_cached_prompt_tokens_for_the_routers(dumps):
    chunks, usage, _ = _filter()
    chunks.chunk(_event(dumps, {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3,
                                                         "prompt_tokens_details": {"cached_tokens": 32}}}))
    assert (usage.prompt_tokens, usage.cached_tokens) == (40, 32)


# ---- typed events -------------------------------------------------------------------------------------------

def test_a_responses_stream_counts_its_deltas_until_the_final_usage_and_notes_an_error():
    chunks, usage, tokens = _filter(RESPONSES)
    delta = _sse("response.output_text.delta", {"type": "response.output_text.delta", "delta": "a"})
    sent = [_sse("response.created", {"type": "response.created", "response": {}}), delta, delta]
    assert [chunks.chunk(e) for e in sent] == sent, "typed events pass unchanged"
    assert (usage.prompt_tokens, usage.completion_tokens, len(tokens)) == (0, 2, 2)
    chunks.chunk(_sse("response.completed", {"type": "response.completed",
                                             "response": {"usage": {"input_tokens": 12, "output_tokens": 5}}}))
    assert (usage.prompt_tokens, usage.completion_tokens) == (12, 5)
    chunks.chunk(delta)
    assert usage.completion_tokens == 5, "the engine's count stands once it came"
    assert chunks.in_band_error is None
    chunks.chunk(_sse("error", {"type": "error", "code": "boom", "message": "engine died"}))
    assert chunks.in_band_error == {"message": "engine died", "code": "boom"}


def test_a_messages_stream_reads_anthropics_error_event():
    chunks, _, _ = _filter(MESSAGES)
    chunks.chunk(_sse("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}))
    assert chunks.in_band_error == {"message": "busy", "type": "overloaded_error", "code": 500}


# ---- what a client that left is charged -----------------------------------------------------------------------

def test_a_client_that_left_is_counted_at_the_larger_of_what_was_relayed_and_what_the_replica_reported(dumps):
    whole = Usage()
    whole.working(Working(prompt_tokens=35, completion_tokens=12))
    assert (whole.prompt_tokens, whole.completion_tokens) == (0, 0), "counted only once the client has left"
    whole.client_left()
    assert (whole.prompt_tokens, whole.completion_tokens) == (35, 12)
    chunks, stream, _ = _filter()
    chunks.chunk(_event(dumps, {"choices": [{"index": 0, "delta": {"content": "a"}}],
                                "usage": {"prompt_tokens": 7, "completion_tokens": 3}}))
    stream.client_left()  # a stream has no heartbeat: its chunks' running usage stands
    assert (stream.prompt_tokens, stream.completion_tokens) == (7, 3)


def test_a_heartbeat_counts_only_for_its_own_attempt_and_never_over_a_reply_that_came():
    retried = Usage()
    retried.working(Working(prompt_tokens=35, completion_tokens=12))
    retried.new_attempt()  # that replica died; the retry starts over
    retried.client_left()
    assert (retried.prompt_tokens, retried.completion_tokens) == (0, 0)
    served = Usage()
    served.working(Working(prompt_tokens=35, completion_tokens=12))
    served.whole_reply({"usage": {"prompt_tokens": 35, "completion_tokens": 20}})
    assert (served.prompt_tokens, served.completion_tokens) == (35, 20), "the reply's own usage"
