"""Agent APIs of configs/local.yaml against the real engine: tool calling, the Responses API and Anthropic's
Messages API, each through its official client (`openai`, `anthropic`).

The builtin chat model serves tools with the `hermes` parser its shipped chat template calls for
(shunter.catalog). It is a 135M model: left to itself (tool_choice auto) it rarely calls a tool, so the
tests that need a call force one (required, or a named function); vLLM then constrains the output to the
tool-call format, and `strict` tools to their argument schema, so the arguments always parse. A `city`
drawn from an enum keeps those arguments a few tokens long. The auto test instead asks the model to copy
a call in the parser's format, which it does, so that the parser has a call to find.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from .live import CHAT_MODEL, EMBED_MODEL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
# Responses and Anthropic tools are flat: no `function` wrapper.
RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "strict": True,
                     "description": WEATHER["function"]["description"],
                     "parameters": WEATHER["function"]["parameters"]}
# A call in the hermes format, for the model to copy (tool_choice auto: the parser must find it in the text).
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
COPY_A_CALL = [{"role": "user", "content": f"Repeat exactly, and nothing else:\n{CALL_TEXT}"}]
ANTHROPIC_WEATHER = {"name": "get_weather", "description": WEATHER["function"]["description"], "strict": True,
                     "input_schema": WEATHER["function"]["parameters"]}


def _arguments(call) -> dict:
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "London"), arguments
    return arguments


# ---- tool calling through chat completions --------------------------------------------------------------

def test_a_named_tool_choice_returns_a_call_whose_arguments_parse(live_app):
    resp = live_app.openai().chat.completions.create(
        model=CHAT_MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason in ("stop", "tool_calls"), resp
    assert [c.function.name for c in message.tool_calls] == ["get_time"]
    _arguments(message.tool_calls[0])
    assert message.tool_calls[0].id


def test_tool_choice_required_streamed_is_assembled_by_the_client(live_app):
    """The client's stream helper assembles the tool-call deltas into whole calls."""
    with live_app.openai().chat.completions.stream(
            model=CHAT_MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60,
            temperature=0) as stream:
        deltas = sum(1 for event in stream if event.type == "tool_calls.function.arguments.delta")
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert deltas >= 1 and len(calls) >= 1 and calls[0].function.name == "get_weather", final
    _arguments(calls[0])


def test_tool_choice_auto_turns_a_call_the_model_writes_into_a_tool_call(live_app):
    """With tool_choice auto nothing constrains the output: the hermes parser reads the model's text and
    turns a call written in its format into a tool call. The model is asked to copy one (it calls no tool
    by itself, see above); tool_choice none shows the text the engine wrote for the same prompt (the tools
    are in the prompt either way), and auto must give exactly that call, parsed, and no text."""
    client = live_app.openai()
    asked = {"model": CHAT_MODEL, "messages": COPY_A_CALL, "tools": [WEATHER, TIME], "max_tokens": 60,
             "temperature": 0}
    raw = client.chat.completions.create(tool_choice="none", **asked)
    text = raw.choices[0].message.content or ""
    written = re.search(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
    assert written and not raw.choices[0].message.tool_calls, f"the model did not write the call: {text!r}"
    expected = json.loads(written.group(1))
    auto = client.chat.completions.create(tool_choice="auto", **asked)
    assert auto.usage.prompt_tokens == raw.usage.prompt_tokens, "the same prompt both times"
    choice = auto.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []] == \
        [(expected["name"], expected["arguments"])], choice.message
    assert choice.message.tool_calls[0].id
    assert not (choice.message.content or "").strip(), "the call is not left in the text as well"


def test_tool_choice_none_answers_in_text(live_app):
    resp = live_app.openai().chat.completions.create(model=CHAT_MODEL, messages=ASK, tools=[WEATHER],
                                                     tool_choice="none", max_tokens=20, temperature=0)
    assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls


def test_a_two_turn_tool_conversation_sends_the_result_back(live_app):
    client = live_app.openai()
    first = client.chat.completions.create(model=CHAT_MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    _arguments(call)
    turn = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees Celsius."}]
    second = client.chat.completions.create(model=CHAT_MODEL, messages=turn, tools=[WEATHER], tool_choice="none",
                                            max_tokens=30, temperature=0)
    assert second.choices[0].message.content
    # The tool's result reached the prompt: the second turn is the first one's prompt and more.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


def test_tool_definitions_count_toward_the_prompt(live_app):
    client = live_app.openai()
    bare = client.chat.completions.create(model=CHAT_MODEL, messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(model=CHAT_MODEL, messages=ASK, tools=[WEATHER, TIME],
                                                tool_choice="none", max_tokens=1)
    assert with_tools.usage.prompt_tokens > bare.usage.prompt_tokens + 50


def test_the_agent_apis_refuse_an_embedding_model_naming_the_problem(live_app):
    resp = httpx.post(f"{live_app.v1}/responses", timeout=60, json={"model": EMBED_MODEL, "input": "hi"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_not_supported", resp.text


# ---- the Responses API ----------------------------------------------------------------------------------

def test_responses_plain(live_app):
    resp = live_app.openai().responses.create(model=CHAT_MODEL, input="What is the capital of France?",
                                              instructions="Answer in one sentence.", max_output_tokens=30,
                                              temperature=0)
    assert resp.status in ("completed", "incomplete") and resp.output_text
    assert resp.usage.input_tokens > 0 and 0 < resp.usage.output_tokens <= 30
    assert resp.model == CHAT_MODEL


def test_responses_streamed_events_in_order_with_final_usage(live_app):
    with live_app.openai().responses.stream(model=CHAT_MODEL, input="Say hello.", max_output_tokens=12,
                                            temperature=0) as stream:
        received = list(stream)
    final = received[-1].response  # get_final_response() wants response.completed; a cut stream is incomplete
    events = [(event.type, event.sequence_number) for event in received]
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
    first_delta = kinds.index("response.output_text.delta")
    assert kinds.index("response.output_item.added") < first_delta < kinds.index("response.output_text.done")
    assert [number for _, number in events] == list(range(len(events))), events
    assert 0 < final.usage.output_tokens <= 12 and final.usage.input_tokens > 0
    deltas = "".join(event.delta for event in received if event.type == "response.output_text.delta")
    assert final.output_text and final.output_text == deltas


def test_responses_with_a_forced_function_call(live_app):
    resp = live_app.openai().responses.create(model=CHAT_MODEL, input="What is the weather in Paris?",
                                              tools=[RESPONSES_WEATHER], tool_choice="required",
                                              max_output_tokens=60, temperature=0)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather", resp.output
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "London")


def test_responses_refuses_state_it_does_not_keep(live_app):
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        live_app.openai().responses.create(model=CHAT_MODEL, input="and then?", previous_response_id="resp_123")
    assert refused.value.body["param"] == "previous_response_id"
    assert refused.value.body["code"] == "unsupported_parameter"


# ---- Anthropic's Messages API ---------------------------------------------------------------------------

def test_messages_plain(live_app):
    message = live_app.anthropic().messages.create(
        model=CHAT_MODEL, max_tokens=30, system="Answer in one sentence.",
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert message.role == "assistant" and message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 30


def test_messages_streamed(live_app):
    with live_app.anthropic().messages.stream(model=CHAT_MODEL, max_tokens=12,
                                              messages=[{"role": "user", "content": "Say hello."}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.usage.output_tokens > 0 and final.stop_reason in ("end_turn", "max_tokens")


def _content_blocks(events: list) -> list[tuple[str, list]]:
    """The content blocks of a streamed Messages reply, checked against the event order Anthropic documents:
    message_start; per block, in index order, content_block_start, one or more content_block_delta and
    content_block_stop; then message_delta; then message_stop (pings may come anywhere). Returns each
    block's type and deltas."""
    kinds = [event.type for event in events]
    events = [event for event in events if event.type != "ping"]
    assert events[0].type == "message_start" and [e.type for e in events[-2:]] == ["message_delta", "message_stop"], \
        kinds
    blocks, inner = [], events[1:-2]
    while inner:
        start, inner = inner[0], inner[1:]
        assert start.type == "content_block_start" and start.index == len(blocks), kinds
        deltas = []
        while inner and inner[0].type == "content_block_delta":
            assert inner[0].index == start.index, kinds
            deltas.append(inner[0].delta)
            inner = inner[1:]
        assert deltas and inner and inner[0].type == "content_block_stop" and inner[0].index == start.index, kinds
        inner = inner[1:]
        blocks.append((start.content_block.type, deltas))
    assert blocks, f"no content block: {kinds}"
    return blocks


@pytest.mark.parametrize("tool", [False, True], ids=["text", "tool_use"])
def test_messages_streamed_events_come_in_anthropics_order(live_app, tool):
    """The raw event stream (not the SDK's accumulating helper), for a text reply and a forced tool call."""
    extra = {"tools": [ANTHROPIC_WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}} if tool else {}
    with live_app.anthropic().messages.create(
            model=CHAT_MODEL, max_tokens=60 if tool else 12, stream=True,
            messages=[{"role": "user", "content": "What is the weather in Paris?" if tool else "Say hello."}],
            **extra) as stream:
        events = list(stream)
    blocks = _content_blocks(events)
    start, end = events[0].message, next(e for e in events if e.type == "message_delta")
    assert start.role == "assistant" and start.content == [] and start.usage.input_tokens > 0, start
    assert end.usage.output_tokens > 0, end
    if tool:
        kind, deltas = blocks[-1]
        assert kind == "tool_use" and {d.type for d in deltas} == {"input_json_delta"}, blocks
        assert json.loads("".join(d.partial_json for d in deltas))["city"] in ("Paris", "London")
        assert end.delta.stop_reason == "tool_use"
    else:
        assert [kind for kind, _ in blocks] == ["text"] and {d.type for d in blocks[0][1]} == {"text_delta"}
        assert "".join(d.text for d in blocks[0][1]).strip()
        assert end.delta.stop_reason in ("end_turn", "max_tokens")


def test_messages_with_a_forced_tool(live_app):
    message = live_app.anthropic().messages.create(
        model=CHAT_MODEL, max_tokens=60, tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and uses[0].input["city"] in ("Paris", "London"), message


def test_messages_errors_come_in_anthropics_shape(live_app):
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as missing:
        live_app.anthropic().messages.create(model="no-such-model", max_tokens=5,
                                             messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        live_app.anthropic().messages.create(model=CHAT_MODEL, max_tokens=-1,
                                             messages=[{"role": "user", "content": "hi"}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"


# ---- what /v1/models says -------------------------------------------------------------------------------

def test_models_say_what_each_model_supports(live_app):
    cards = {card["id"]: card for card in httpx.get(f"{live_app.v1}/models", timeout=30).json()["data"]}
    chat = cards[CHAT_MODEL]["capabilities"]
    assert "/v1/responses" in chat["endpoints"] and "/v1/messages" in chat["endpoints"]
    assert chat["tools"] == {"tool_call_parser": "hermes", "tool_choice": ["none", "auto", "required", "function"]}
    assert chat["reasoning"] == {"enabled_by": "serving.reasoning_parser"}
    assert cards[EMBED_MODEL]["capabilities"] == {"endpoints": ["/v1/embeddings"]}
