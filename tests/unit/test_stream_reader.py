"""A streamed reply as the replica reads it (shunter.deployments.replica.stream_reader; issue 39: relay bytes,
not objects): the engine's SSE texts pass to the gateway byte for byte, each beside the tokens the request
had produced in the engine (`counts`, the engine's own per-request state), and one `StreamEnd` says the
stream's final usage and the error event it carried. Only the replica decodes anything of a stream, and
only its final usage and its error events, so these tests pin what it reads and what it leaves alone: the
final usage chunk the platform asks the engine for is dropped unless the client asked for it, a client's
running usage passes untouched, an in-band error is noted in either JSON layout, the typed events of the
Responses and Messages APIs give their usage and errors, and the end never charges less than the engine
counted. (What the gateway keeps of these is tests/unit/test_stream_account.py's.)"""

from __future__ import annotations

import json

import pytest

from shunter.deployments.replica.stream_reader import StreamReader, engine_stream_body
from shunter.endpoints import CHAT, COMPLETION, MESSAGES, RESPONSES
from shunter.replica_protocol import StreamChunk, StreamEnd
from shunter.wire_formats import OPENAI_CHUNKS

pytestmark = pytest.mark.unit

# vLLM's own layout (pydantic's compact JSON) and a spaced one (another engine's, or json.dumps'): the
# reader finds the final usage chunk and the error event in both.
LAYOUTS = {"vllm": {"separators": (",", ":"), "ensure_ascii": False}, "spaced": {}}
DONE = "data: [DONE]\n\n"


@pytest.fixture(params=sorted(LAYOUTS))
def dumps(request):
    return lambda obj: json.dumps(obj, **LAYOUTS[request.param])


def _event(dumps, obj) -> str:
    return "data: " + dumps(obj) + "\n\n"


def _chunk(dumps, content: str, model: str = "m") -> str:
    return _event(dumps, {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": model,
                          "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]})


def _usage(dumps, prompt: int = 7, completion: int = 3, **details) -> str:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if details:
        usage["prompt_tokens_details"] = details
    return _event(dumps, {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": usage})


def _running(dumps, content: str, completion: int, prompt: int = 7) -> str:
    """A chunk with vLLM's running usage (`continuous_usage_stats`), which only a client asks for now."""
    return _event(dumps, {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                          "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
                          "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                    "total_tokens": prompt + completion}})


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


class Engine:
    """The engine's count of one request's tokens, as the replica reads it (`shunter.engine_usage`): the
    prompt from the start, and as many completion tokens as the test says it has produced."""

    def __init__(self, prompt: int = 7):
        self.prompt, self.completion, self.reads = prompt, 0, 0

    def __call__(self) -> tuple[int, int]:
        self.reads += 1
        return self.prompt, self.completion


def _read(reader: StreamReader, texts: list[str], engine: Engine | None = None) -> list[StreamChunk | None]:
    """Each text as the replica hands it to the reader, the engine having produced one more token for each
    text that carries one (a non-empty `choices`, a typed delta)."""
    read = []
    for text in texts:
        if engine is not None and ('"choices":[{' in text or '"choices": [{' in text or ".delta" in text
                                   or "content_block_delta" in text):
            engine.completion += 1
        read.append(reader.chunk(text))
    return read


# ---- the body the engine runs ----------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", [CHAT, COMPLETION])
def test_an_openai_format_stream_always_asks_the_engine_for_its_final_usage_without_changing_the_clients_body(
        endpoint):
    body = {"model": "m", "stream": True, "stream_options": {"unknown_option": 1}}
    sent, wanted = engine_stream_body(body, endpoint.wire)
    assert sent["stream_options"] == {"unknown_option": 1, "include_usage": True} and not wanted
    assert body == {"model": "m", "stream": True, "stream_options": {"unknown_option": 1}}, "the client's body stays"
    sent, wanted = engine_stream_body({"model": "m", "stream": True}, endpoint.wire)
    assert sent["stream_options"] == {"include_usage": True} and not wanted
    assert "continuous_usage_stats" not in sent["stream_options"], "no running usage the client did not ask for"


def test_a_client_that_asked_for_the_usage_chunk_gets_its_own_options_unchanged():
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    sent, wanted = engine_stream_body(body, OPENAI_CHUNKS)
    assert sent == body and wanted


def test_running_usage_is_not_turned_on_by_the_usage_chunk_the_platform_asks_for():
    """vLLM honours `continuous_usage_stats` only beside `include_usage`: a client that sent the first
    alone asked for nothing, and the replica's own `include_usage` must not give it usage on every chunk."""
    body = {"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    sent, wanted = engine_stream_body(body, OPENAI_CHUNKS)
    assert sent["stream_options"] == {"include_usage": True} and not wanted


@pytest.mark.parametrize("endpoint", [RESPONSES, MESSAGES])
def test_typed_event_streams_and_whole_replies_run_as_the_client_sent_them(endpoint):
    """Typed-event streams end with their usage; an OpenAI `stream_options` would be a field vLLM refuses."""
    streamed = {"model": "m", "stream": True}
    assert engine_stream_body(streamed, endpoint.wire) == (streamed, False)
    whole = {"model": "m", "stream": False}
    assert engine_stream_body(whole, CHAT.wire) == (whole, False)


# ---- OpenAI chunks ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("client_asked", [False, True])
def test_the_final_usage_chunk_reaches_only_a_client_that_asked_and_counts_either_way(client_asked, dumps):
    engine = Engine()
    reader = StreamReader(OPENAI_CHUNKS, engine, usage_chunk_wanted=client_asked)
    texts = [_chunk(dumps, "a"), _chunk(dumps, "b"), _usage(dumps, 7, 2), DONE]
    read = _read(reader, texts, engine)
    assert [c.text if c is not None else None for c in read] == \
        [texts[0], texts[1], texts[2] if client_asked else None, DONE], "the engine's own bytes, or nothing"
    assert reader.end() == StreamEnd(7, 2, None, None)


def test_running_usage_a_client_asked_for_passes_untouched(dumps):
    engine = Engine()
    reader = StreamReader(OPENAI_CHUNKS, engine, usage_chunk_wanted=True)
    texts = [_running(dumps, "a", 1), _running(dumps, 'b"}, "usage": {', 2), _usage(dumps, 7, 2), DONE]
    read = _read(reader, texts, engine)
    assert [c.text for c in read if c is not None] == texts, "every byte the engine sent, usage and all"
    assert [(c.prompt_tokens, c.completion_tokens) for c in read if c is not None] == [(7, 1), (7, 2), (7, 2), (7, 2)]


def test_each_chunk_carries_the_engines_running_count_beside_its_unchanged_text(dumps):
    """The count is what the engine had produced when the chunk was made (read from `counts` for each one),
    not anything in the chunk: a role chunk has 0 completion tokens, a chunk of two tokens counts two."""
    engine = Engine(prompt=11)
    reader = StreamReader(OPENAI_CHUNKS, engine, usage_chunk_wanted=False)
    role = _event(dumps, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    assert reader.chunk(role) == StreamChunk(role, 11, 0)
    engine.completion = 2
    two = _chunk(dumps, "ab")
    assert reader.chunk(two) == StreamChunk(two, 11, 2)
    engine.completion = 3
    assert reader.chunk(DONE) == StreamChunk(DONE, 11, 3)
    assert engine.reads == 3, "one lookup per chunk"


def test_a_renamed_model_is_relayed_as_the_replica_wrote_it(dumps):
    """The replica renames an adapter's version to the client's name before the reader sees the chunk; the
    reader reads no `model` and changes no byte."""
    reader = StreamReader(OPENAI_CHUNKS, Engine(), usage_chunk_wanted=False)
    text = _chunk(dumps, "a", model="sql")
    assert reader.chunk(text).text == text  # type: ignore[union-attr]


def test_an_error_event_inside_a_stream_reaches_the_client_and_is_noted_in_its_end(dumps):
    engine = Engine()
    reader = StreamReader(OPENAI_CHUNKS, engine, usage_chunk_wanted=False)
    error = {"message": "EngineCore died", "type": "InternalServerError", "code": 500}
    texts = [_chunk(dumps, "a"), _event(dumps, {"error": error}), DONE]
    read = _read(reader, texts, engine)
    assert [c.text for c in read if c is not None] == texts, "the client sees it"
    assert reader.end() == StreamEnd(7, 1, None, error)


def test_an_error_that_is_not_an_object_is_noted_as_its_message():
    reader = StreamReader(OPENAI_CHUNKS, Engine(), usage_chunk_wanted=False)
    reader.chunk('data: {"error": "engine died"}\n\n')
    assert reader.end().error == {"message": "engine died"}


def test_the_requests_own_fault_is_its_error_event_at_the_count_so_far():
    engine = Engine()
    reader = StreamReader(OPENAI_CHUNKS, engine, usage_chunk_wanted=False)
    _read(reader, ['data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'], engine)
    error = {"message": "bad tool arguments", "type": "invalid_request_error", "code": "invalid_request"}
    text = OPENAI_CHUNKS.error_event("bad tool arguments", 400, "invalid_request")
    assert reader.fault(text, error) == StreamChunk(text, 7, 1)
    assert reader.end() == StreamEnd(7, 1, None, error)


# ---- the end: the final usage, never less than the engine counted -------------------------------------------

@pytest.mark.parametrize(("running", "final", "charged"), [
    ((7, 5), (7, 3), (7, 5)),  # the final usage fell short of what the engine's state says it produced
    ((7, 2), (7, 3), (7, 3)),  # the last token came with the usage chunk, after the last count
    ((0, 0), (7, 3), (7, 3)),
])
def test_the_end_takes_the_larger_of_the_final_usage_and_the_running_count(running, final, charged, dumps):
    engine = Engine()
    reader = StreamReader(OPENAI_CHUNKS, engine, usage_chunk_wanted=False)
    reader.chunk(_usage(dumps, *final))
    engine.prompt, engine.completion = running
    assert reader.end()[:2] == charged


def test_the_end_without_a_final_usage_is_the_running_count_read_at_the_end(dumps):
    engine = Engine()
    reader = StreamReader(OPENAI_CHUNKS, engine, usage_chunk_wanted=False)
    _read(reader, [_chunk(dumps, "a")], engine)
    engine.completion = 4  # produced while the stream was being cut
    assert reader.end() == StreamEnd(7, 4, None, None)


def test_the_final_usage_carries_the_cached_prompt_tokens_for_the_routers(dumps):
    reader = StreamReader(OPENAI_CHUNKS, Engine(40), usage_chunk_wanted=False)
    reader.chunk(_usage(dumps, 40, 3, cached_tokens=32))
    assert reader.end() == StreamEnd(40, 3, 32, None)


def test_an_engine_that_cannot_count_is_charged_its_final_usage(dumps):
    reader = StreamReader(OPENAI_CHUNKS, None, usage_chunk_wanted=False)
    text = _chunk(dumps, "a")
    assert reader.chunk(text) == StreamChunk(text, 0, 0)
    assert reader.chunk(_usage(dumps, 7, 3)) is None
    assert reader.end() == StreamEnd(7, 3, None, None)
    assert StreamReader(OPENAI_CHUNKS, None, usage_chunk_wanted=False).end() == StreamEnd(0, 0, None, None)


# ---- typed events ---------------------------------------------------------------------------------------------

_DELTA = "response.output_text.delta"


@pytest.mark.parametrize("counted", [True, False])
def test_a_responses_stream_ends_with_the_usage_of_its_last_event(counted):
    engine = Engine(prompt=12) if counted else None
    reader = StreamReader(RESPONSES.wire, engine, usage_chunk_wanted=False)
    delta = _sse(_DELTA, {"type": _DELTA, "delta": "a"})
    texts = [_sse("response.created", {"type": "response.created", "response": {}}), delta, delta,
             _sse("response.completed", {"type": "response.completed",
                                         "response": {"usage": {"input_tokens": 12, "output_tokens": 5}}})]
    read = _read(reader, texts, engine)
    assert [c.text for c in read if c is not None] == texts, "typed events pass unchanged, the usage too"
    assert [c.completion_tokens for c in read if c is not None] == ([0, 1, 2, 2] if counted else [0, 0, 0, 0])
    assert reader.end() == StreamEnd(12, 5, None, None)


def test_a_responses_streams_error_event_is_noted():
    reader = StreamReader(RESPONSES.wire, Engine(), usage_chunk_wanted=False)
    text = _sse("error", {"type": "error", "code": "boom", "message": "engine died"})
    assert reader.chunk(text).text == text  # type: ignore[union-attr]
    assert reader.end().error == {"message": "engine died", "code": "boom"}


def test_a_messages_stream_takes_its_prompt_first_and_its_completion_last():
    engine = Engine(prompt=9)
    reader = StreamReader(MESSAGES.wire, engine, usage_chunk_wanted=False)
    delta = _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "text_delta", "text": "a"}})
    _read(reader, [_sse("message_start", {"type": "message_start", "message": {
        "usage": {"input_tokens": 9, "output_tokens": 0}}}), delta, delta, delta], engine)
    engine.completion = 3  # the engine's state was read with each delta; the final usage says 4
    reader.chunk(_sse("message_delta", {"type": "message_delta", "usage": {"output_tokens": 4}}))
    reader.chunk(_sse("message_stop", {"type": "message_stop"}))
    assert reader.end() == StreamEnd(9, 4, None, None)


def test_a_messages_stream_reads_anthropics_error_event():
    reader = StreamReader(MESSAGES.wire, Engine(), usage_chunk_wanted=False)
    reader.chunk(_sse("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}))
    assert reader.end().error == {"message": "busy", "type": "overloaded_error", "code": 500}


def _objects(stream: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in stream.split("\n")
            if line.startswith("data: {")]


def test_every_chunk_says_the_tier_served_and_nothing_else_changes(dumps):
    """OpenAI's chunks each carry `service_tier`: the replica writes the class's tier (the gateway put it in
    the body) first into each chunk object, the usage chunk too; an error event and [DONE] stay as sent."""
    tier = "flex"
    reader = StreamReader(OPENAI_CHUNKS, None, usage_chunk_wanted=True, tier=tier)
    sent = [_chunk(dumps, "Hel"), _chunk(dumps, 'lo "data: {"\n'), _usage(dumps), DONE]
    written = [reader.chunk(text).text for text in sent]
    assert [o["service_tier"] for o in _objects("".join(written))] == [tier] * 3
    for before, after in zip(sent[:3], written[:3], strict=True):
        assert {k: v for k, v in _objects(after)[0].items() if k != "service_tier"} == _objects(before)[0]
    assert written[3] == DONE
    error = _event(dumps, {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
    assert reader.chunk(error).text == error
    # Two events in one text: each marked, the content that looks like an event start left alone.
    both = reader.chunk(_chunk(dumps, "a") + _chunk(dumps, "data: {\"b")).text
    assert [o["service_tier"] for o in _objects(both)] == [tier, tier]
    assert [o["choices"][0]["delta"]["content"] for o in _objects(both)] == ["a", 'data: {"b']


def test_a_reply_says_its_tier_only_on_openais_chunk_apis():
    from shunter.deployments.replica.stream_reader import chunk_tier
    from shunter.endpoints import EMBEDDING

    assert chunk_tier(CHAT, {"service_tier": "priority"}) == "priority"
    assert chunk_tier(COMPLETION, {"service_tier": "default"}) == "default"
    # Responses objects echo the request's tier (vLLM); Messages and embeddings have no OpenAI tier.
    assert [chunk_tier(e, {"service_tier": "flex"}) for e in (RESPONSES, MESSAGES, EMBEDDING)] == [None] * 3
    assert chunk_tier(CHAT, {}) is None and chunk_tier(CHAT, {"service_tier": 'x","y'}) is None
    plain = StreamReader(OPENAI_CHUNKS, None, usage_chunk_wanted=False)
    text = _chunk(json.dumps, "x")
    assert plain.chunk(text).text == text, "no tier: the bytes pass as they are"
