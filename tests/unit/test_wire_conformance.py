"""The replica's Responses and Messages replies as the official SDKs read them (shunter.wire_conformance):
vLLM's own objects, built with vLLM's own protocol classes and converters, serialised the way the engine
adapter does, then parsed with the `openai` and `anthropic` SDKs' types."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import TypeAdapter

from shunter.engine import _typed_events
from shunter.wire_conformance import anthropic_message, incomplete_responses_event, openai_responses_stream

pytestmark = pytest.mark.unit

MODEL = "smollm2-135m-instruct"
RESPONSES_DUMP = {"mode": "json", "by_alias": True}  # VLLMEngine.responses' `dump`
MESSAGES_DUMP = {"exclude_none": True}  # VLLMEngine.messages' `dump`


# ---- the Responses API --------------------------------------------------------------------------------------

def _vllm_response(status: str) -> Any:
    """A ResponsesResponse as vLLM's Responses layer makes it (`from_request`) for a 4-token answer."""
    from openai.types.responses import ResponseOutputMessage, ResponseOutputText
    from vllm.entrypoints.openai.responses.protocol import (
        InputTokensDetails,
        OutputTokensDetails,
        ResponsesRequest,
        ResponsesResponse,
        ResponseUsage,
    )
    from vllm.sampling_params import SamplingParams

    request = ResponsesRequest.model_validate({"model": MODEL, "input": "Say hello.", "max_output_tokens": 4,
                                               "stream": True})
    message = ResponseOutputMessage(id="msg_1", type="message", role="assistant", status="completed",
                                    content=[ResponseOutputText(type="output_text", text="Hello! How can",
                                                                annotations=[], logprobs=None)])
    usage = ResponseUsage(input_tokens=31, input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
                          output_tokens=4, output_tokens_details=OutputTokensDetails(), total_tokens=35)
    return ResponsesResponse.from_request(request, SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0),
                                          MODEL, 1_700_000_000, [message], status, usage=usage)


def _vllm_stream_events(status: str) -> list[Any]:
    """The tail of a vLLM Responses stream: a text delta, then its final event (always
    `response.completed`, whatever the response's status)."""
    from openai.types.responses import ResponseTextDeltaEvent
    from vllm.entrypoints.openai.responses.protocol import ResponseCompletedEvent

    delta = ResponseTextDeltaEvent(type="response.output_text.delta", item_id="msg_1", output_index=0,
                                   content_index=0, delta="Hello", logprobs=[], sequence_number=5)
    final = ResponseCompletedEvent(type="response.completed", sequence_number=6, response=_vllm_response(status))
    return [delta, final]


async def _aiter(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def _collect(stream: AsyncIterator[str]) -> list[str]:
    async def run() -> list[str]:
        return [chunk async for chunk in stream]

    return asyncio.run(run())


def _openai_event(chunk: str) -> Any:
    """One SSE event as the OpenAI SDK parses a Responses stream's data."""
    from openai.types.responses import ResponseStreamEvent

    name, data = chunk.split("\n", 1)
    assert name.startswith("event: ") and data.startswith("data: ") and chunk.endswith("\n\n"), chunk
    event = TypeAdapter(ResponseStreamEvent).validate_json(data[len("data: "):])
    assert event.type == name[len("event: "):], "the event line names the data's type"
    return event


def test_a_responses_stream_cut_by_max_output_tokens_ends_with_response_incomplete():
    events = _vllm_stream_events("incomplete")
    vllm_chunks = _collect(_typed_events(_aiter(events)))
    assert vllm_chunks[-1].startswith("event: response.completed\n"), "what vLLM sends (the gap)"

    chunks = _collect(openai_responses_stream(_typed_events(_aiter(events))))  # as VLLMEngine.responses
    assert chunks[0] == vllm_chunks[0], "every event but the last passes as vLLM wrote it"
    final = _openai_event(chunks[-1])
    from openai.types.responses import ResponseIncompleteEvent

    assert isinstance(final, ResponseIncompleteEvent) and final.type == "response.incomplete"
    assert final.sequence_number == 6
    assert final.response.status == "incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.output_text == "Hello! How can" and final.response.usage.output_tokens == 4
    # Nothing else in the event changed: vLLM's data with the one type renamed.
    before = json.loads(vllm_chunks[-1].split("data: ", 1)[1])
    after = json.loads(chunks[-1].split("data: ", 1)[1])
    assert after == {**before, "type": "response.incomplete"}


def test_a_finished_responses_stream_passes_untouched():
    vllm_chunks = _collect(_typed_events(_aiter(_vllm_stream_events("completed"))))
    chunks = _collect(openai_responses_stream(_aiter(vllm_chunks)))
    assert chunks == vllm_chunks
    assert all(a is b for a, b in zip(chunks, vllm_chunks, strict=True)), "not even re-encoded"
    assert _openai_event(chunks[-1]).type == "response.completed"


@pytest.mark.parametrize("chunk", [
    "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\"}\n\n",
    "event: response.completed\ndata: {not json\n\n",
    "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":null}\n\n",
    "event: response.completed\n\n",
    "data: [DONE]\n\n",
])
def test_other_chunks_come_back_as_they_are(chunk):
    assert incomplete_responses_event(chunk) is chunk


def test_a_stream_item_that_is_not_text_passes_through():
    fault = object()  # e.g. the replica's own end-of-stream item
    assert _collect(openai_responses_stream(_aiter(["data: x\n\n", fault]))) == ["data: x\n\n", fault]


def test_a_non_ascii_answer_survives_the_rewrite():
    chunk = ('event: response.completed\ndata: {"type":"response.completed","sequence_number":2,'
             '"response":{"status":"incomplete","output_text":"Grüße 東京"}}\n\n')
    rewritten = incomplete_responses_event(chunk)
    assert rewritten.startswith("event: response.incomplete\ndata: {") and rewritten.endswith("}\n\n")
    assert "Grüße 東京" in rewritten


def test_a_whole_responses_reply_cut_short_is_incomplete_as_openais():
    from openai.types.responses import Response

    body = _vllm_response("incomplete").model_dump(**RESPONSES_DUMP)
    reply = Response.model_validate(body)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    done = Response.model_validate(_vllm_response("completed").model_dump(**RESPONSES_DUMP))
    assert done.status == "completed" and done.incomplete_details is None


# ---- Anthropic's Messages API -------------------------------------------------------------------------------

def _chat_usage(cached: int | None = 0) -> Any:
    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

    details = PromptTokenUsageInfo(cached_tokens=cached) if cached is not None else None
    return UsageInfo(prompt_tokens=12, completion_tokens=4, total_tokens=16, prompt_tokens_details=details)


def _vllm_message(finish_reason: str = "length", stop_reason: Any = None, cached: int | None = 0) -> dict:
    """A whole Messages reply as vLLM's Anthropic layer converts a chat completion, dumped as the engine
    adapter dumps it."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )

    chat = ChatCompletionResponse(
        id="chatcmpl-1", model=MODEL, usage=_chat_usage(cached),
        choices=[ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="Hello!"),
                                              finish_reason=finish_reason, stop_reason=stop_reason)])
    message = AnthropicServingMessages.messages_full_converter(None, chat)  # uses nothing of its instance
    return message.model_dump(**MESSAGES_DUMP)


@pytest.mark.parametrize("cached", [0, None], ids=["prompt-details", "no-prompt-details"])
def test_a_whole_message_carries_stop_sequence_and_the_cache_counts(cached):
    import anthropic.types

    vllm_body = _vllm_message(cached=cached)
    assert "stop_sequence" not in vllm_body, "what vLLM sends (the gap)"
    body = anthropic_message(vllm_body)
    assert body["stop_sequence"] is None and body["stop_reason"] == "max_tokens"
    usage = body["usage"]
    assert {"input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"} <= set(usage)
    assert usage["cache_creation_input_tokens"] is None
    assert usage["cache_read_input_tokens"] == cached  # a count where vLLM had one, else null
    assert body["content"] == [{"type": "text", "text": "Hello!"}], "blocks keep no null fields"
    assert "kv_transfer_params" not in body
    message = anthropic.types.Message.model_validate(body)
    assert message.stop_sequence is None and message.usage.output_tokens == 4
    assert json.loads(json.dumps(body)) == body  # plain JSON, as the gateway sends it


def test_a_matched_stop_sequence_is_kept():
    body = anthropic_message(_vllm_message(finish_reason="stop", stop_reason="\n\n"))
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "\n\n")


def test_an_error_body_is_left_alone():
    error = {"type": "error", "error": {"type": "invalid_request_error", "message": "no"}}
    assert anthropic_message(dict(error)) == error


def _chat_chunk(delta: dict | None, finish_reason: str | None = None, usage: bool = False) -> str:
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
    )

    choices = [] if delta is None else [ChatCompletionResponseStreamChoice(
        index=0, delta=DeltaMessage(**delta), finish_reason=finish_reason)]
    chunk = ChatCompletionStreamResponse(id="chatcmpl-1", model=MODEL, choices=choices,
                                         usage=_chat_usage() if usage else None)
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def test_vllms_streamed_message_events_already_carry_stop_sequence():
    """Streamed Messages pass untouched: vLLM's message_start and message_delta already match Anthropic's
    documented stream (https://docs.anthropic.com/en/docs/build-with-claude/streaming)."""
    import anthropic.types
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    chat = [_chat_chunk({"role": "assistant", "content": ""}, usage=True), _chat_chunk({"content": "Hello"}),
            _chat_chunk({"content": "!"}, finish_reason="length"), _chat_chunk(None, usage=True), "data: [DONE]\n\n"]
    chunks = _collect(AnthropicServingMessages.message_stream_converter(None, _aiter(chat)))
    events = {}
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for chunk in chunks:
        name, data = chunk.split("\n", 1)
        raw = json.loads(data[len("data: "):])
        assert adapter.validate_python(raw).type == raw["type"] == name[len("event: "):]
        events.setdefault(raw["type"], raw)
    assert list(events) == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                            "message_delta", "message_stop"]
    start = events["message_start"]["message"]
    assert start["stop_reason"] is None and "stop_sequence" in start and start["stop_sequence"] is None
    assert start["type"] == "message" and start["role"] == "assistant" and start["content"] == []
    delta = events["message_delta"]["delta"]
    assert delta == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events["message_delta"]["usage"]["output_tokens"] == 4
