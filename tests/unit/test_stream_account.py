"""What the gateway keeps of a stream it relays without reading it (shunter.deployments.gateway.stream_account;
issue 39: relay bytes, not objects): the request's `Usage` follows the counts the replica sends beside each
chunk (so a stream cut short is settled at the tokens it produced), the telemetry is told of a chunk only
when it brought tokens (TTFT and the gaps are the tokens', not a role chunk's), the stream's `StreamEnd`
sets its final usage, cached tokens and in-band error, and nothing but the replica protocol's stream items
is taken. Also the body the engine gets (`context.engine_body`), which leaves a stream's options the
client's now that the replica counts the stream (tests/unit/test_stream_reader.py), and what a client that
left is charged."""

from __future__ import annotations

import pytest

from shunter.deployments.gateway.context import Usage, engine_body
from shunter.deployments.gateway.parsed_request import parse
from shunter.deployments.gateway.stream_account import StreamAccount
from shunter.endpoints import CHAT, COMPLETION, EMBEDDING, MESSAGES, RESPONSES, ParsedRequest
from shunter.replica_protocol import StreamChunk, StreamEnd, Working

pytestmark = pytest.mark.unit

ROLE = 'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
TOKEN = 'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
DONE = "data: [DONE]\n\n"


def _account() -> tuple[StreamAccount, Usage, list[float]]:
    """A stream's account over its own Usage; the token times it tells the telemetry land in the list."""
    usage, tokens = Usage(), []
    return StreamAccount(usage, tokens.append), usage, tokens


# ---- the body the engine gets ----------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", [CHAT, COMPLETION])
def test_a_streams_options_stay_the_clients_and_the_engine_gets_the_canonical_name(endpoint):
    """The gateway no longer asks for usage on a stream: the replica asks the engine for what it needs
    and drops what the client did not ask for. The client's options reach it with their flags as the
    parsed request read them, so the replica decides on typed values ("false" is false)."""
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if endpoint is CHAT else {"prompt": "hi"}
    for options, flags in (({"continuous_usage_stats": False}, (False, False)),
                           ({"include_usage": True}, (True, False)),
                           ({"include_usage": "false", "continuous_usage_stats": "true"}, (False, False)),
                           ({"include_usage": True, "continuous_usage_stats": True}, (True, True)),
                           (None, None)):
        body = {"model": "alias", "stream": True, **prompt, **({"stream_options": options} if options else {})}
        sent = engine_body(parse(endpoint, body), "m", None)
        if flags is None:
            assert "stream_options" not in sent, "none asked for, none added"
        else:
            got = sent["stream_options"]
            assert (got["include_usage"], got["continuous_usage_stats"]) == flags, options
        assert sent["model"] == "m", "the canonical name the engine knows"
        assert body["model"] == "alias", "the client's body is not changed"
    whole = {"model": "m", "stream": False}
    assert engine_body(ParsedRequest(CHAT, whole), "m", None) == whole


@pytest.mark.parametrize("endpoint", [RESPONSES, MESSAGES])
def test_typed_event_streams_get_no_usage_option(endpoint):
    """Their streams end with the usage; an OpenAI `stream_options` would be a field vLLM refuses."""
    sent = engine_body(ParsedRequest(endpoint, {"model": "m", "stream": True}, stream=True), "m", None)
    assert "stream_options" not in sent


def test_the_tenants_cache_salt_goes_where_the_prompt_reaches_the_prefix_cache():
    assert engine_body(ParsedRequest(CHAT, {"model": "m"}), "m", "salt-1")["cache_salt"] == "salt-1"
    assert "cache_salt" not in engine_body(ParsedRequest(EMBEDDING, {"model": "e"}), "e", "salt-1")
    assert "cache_salt" not in engine_body(ParsedRequest(CHAT, {"model": "m"}), "m", None)


# ---- chunks: the replica's counts, the tokens' times ----------------------------------------------------------

def test_each_chunks_bytes_go_to_the_client_and_the_usage_follows_the_replicas_counts():
    account, usage, _ = _account()
    assert account.chunk(StreamChunk(TOKEN, 7, 1)) == TOKEN
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 1)
    assert account.chunk(StreamChunk(TOKEN, 7, 3)) == TOKEN  # a chunk that brought two tokens
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 3)
    # cut here (the client hung up): the request is settled at what the engine had produced
    usage.client_left()
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 3)


def test_only_a_chunk_that_brought_tokens_is_timed():
    """The role chunk, a Responses stream's `response.created` (0 tokens so far) and a chunk whose count
    did not grow (a finish reason, [DONE]) are not tokens: TTFT is the first token's, the gaps the tokens'."""
    account, usage, tokens = _account()
    account.chunk(StreamChunk(ROLE, 7, 0))
    account.chunk(StreamChunk('event: response.created\ndata: {"type":"response.created"}\n\n', 7, 0))
    assert tokens == [] and usage.completion_tokens == 0
    account.chunk(StreamChunk(TOKEN, 7, 1))
    account.chunk(StreamChunk(TOKEN, 7, 2))
    account.chunk(StreamChunk(DONE, 7, 2))
    assert len(tokens) == 2 and tokens[0] <= tokens[1]


def test_a_count_never_goes_back():
    account, usage, tokens = _account()
    account.chunk(StreamChunk(TOKEN, 7, 3))
    account.chunk(StreamChunk(TOKEN, 0, 0))  # an engine that cannot count says 0 beside every chunk
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 3) and len(tokens) == 1


# ---- the end -----------------------------------------------------------------------------------------------------

def test_the_end_sets_the_final_usage_the_cached_tokens_and_the_in_band_error():
    account, usage, tokens = _account()
    account.chunk(StreamChunk(TOKEN, 40, 1))
    assert not account.ended and account.in_band_error is None
    error = {"message": "engine died", "type": "InternalServerError", "code": 500}
    account.end(StreamEnd(40, 3, 32, error))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (40, 3, 32)
    assert account.ended and account.in_band_error == error
    assert len(tokens) == 1, "the end is no token of its own once tokens came"


def test_tokens_that_came_with_no_chunk_of_their_own_still_had_a_first():
    """An engine that cannot count sends 0 beside every chunk: the end's usage is the first the gateway
    hears of the tokens, and the request still has a first token (at the end)."""
    account, usage, tokens = _account()
    account.chunk(StreamChunk(TOKEN, 0, 0))
    account.end(StreamEnd(7, 3))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (7, 3, None)
    assert len(tokens) == 1 and account.in_band_error is None


def test_take_gives_a_chunks_bytes_notes_the_end_and_refuses_anything_else():
    account, usage, _ = _account()
    assert account.take(StreamChunk(TOKEN, 7, 1)) == TOKEN
    assert account.take(StreamEnd(7, 2)) is None and account.ended
    assert usage.completion_tokens == 2
    for stray in (TOKEN, None, Working(7, 1)):  # raw text: a replica of before issue 39; the old end mark
        with pytest.raises(RuntimeError, match="replica protocol"):
            _account()[0].take(stray)


# ---- what a client that left is charged -----------------------------------------------------------------------

def test_a_client_that_left_is_counted_at_the_larger_of_what_was_relayed_and_what_the_replica_reported():
    whole = Usage()
    whole.working(Working(prompt_tokens=35, completion_tokens=12))
    assert (whole.prompt_tokens, whole.completion_tokens) == (0, 0), "counted only once the client has left"
    whole.client_left()
    assert (whole.prompt_tokens, whole.completion_tokens) == (35, 12)
    account, stream, _ = _account()
    account.chunk(StreamChunk(TOKEN, 7, 3))
    stream.client_left()  # a stream has no heartbeat: its chunks' running counts stand
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
