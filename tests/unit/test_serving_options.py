"""`serving:` options (vLLM's frontend arguments), the builtin chat template that renders tools, and the
platform's reading of the agent APIs: Responses and Messages bodies, their stream events (read by the
replica, counted by the gateway's stream account), error shapes, and the 400s for what a model's serving
options leave off."""

from __future__ import annotations

import dataclasses

import pytest

from shunter.chat_templates import CHATML_TOOLS, SMOLLM2_SYSTEM
from shunter.config import ModelConfig, ServingConfig, format_config_error, parse_config
from shunter.deployments.gateway.context import Usage
from shunter.deployments.gateway.forward import check_serving
from shunter.deployments.gateway.parsed_request import parse
from shunter.deployments.gateway.stream_account import StreamAccount
from shunter.endpoints import ENDPOINTS
from shunter.errors import ApiError
from shunter.wire_formats import anthropic_error, whole_usage
from tests.unit.test_forward import EngineStream

pytestmark = pytest.mark.unit

CHAT = {"name": "chat", "source": "builtin:smollm2-135m-instruct"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _model(**serving) -> ModelConfig:
    return ModelConfig.model_validate({**CHAT, "serving": serving})


def _config_error(serving: dict) -> str:
    with pytest.raises(Exception) as failed:
        parse_config({"models": [{**CHAT, "serving": serving}]})
    return "\n".join(format_config_error(failed.value)) if hasattr(failed.value, "errors") else str(failed.value)


# ---- the options, against vLLM's own definitions ----------------------------------------------------------

def test_every_option_names_an_argument_vllm_defines():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    vllm_fields = {f.name for f in dataclasses.fields(FrontendArgs)} | \
        {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    # Each option is named as vLLM names its argument, and sets exactly that argument.
    assert set(ServingConfig.model_fields) <= vllm_fields
    assert set(ServingConfig().vllm_arguments()) == set(ServingConfig.model_fields)


def test_vllms_parser_takes_the_arguments_the_options_set(tmp_path):
    """The replica writes these values into vLLM's own argument namespace and runs vLLM's own checks."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    serving = _model(tool_call_parser="hermes", reasoning_parser="deepseek_r1", chat_template=str(template),
                     default_chat_template_kwargs={"enable_thinking": False}).serving
    namespace = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m"])
    for key, value in serving.vllm_arguments().items():
        assert hasattr(namespace, key), key
        setattr(namespace, key, value)
    validate_parsed_serve_args(namespace)
    assert namespace.enable_auto_tool_choice is True  # on with a parser, unless the file says otherwise


@pytest.mark.parametrize("serving, says", [
    ({"tool_call_parser": "hermez"}, "did you mean 'hermes'"),
    ({"reasoning_parser": "deepseek-r1"}, "did you mean 'deepseek_r1'"),
    ({"chat_template": "/no/such/template.jinja"}, "is not a file"),
    ({"tool_call_parser": None, "enable_auto_tool_choice": True}, "needs tool_call_parser"),
    ({"response_role": ""}, "response_role"),
    ({"tool_parser": "hermes"}, "tool_parser"),  # unknown key
])
def test_bad_options_fail_before_anything_starts_naming_the_field(serving, says):
    error = _config_error(serving)
    assert "serving" in error and says in error, error


def test_a_template_that_is_not_jinja_is_refused_with_its_line(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n")
    error = _config_error({"chat_template": str(broken)})
    assert "not valid Jinja" in error and "line 2" in error, error


def test_a_template_path_is_kept_absolute(tmp_path, monkeypatch):
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    monkeypatch.chdir(tmp_path)
    assert _model(chat_template="t.jinja").serving.chat_template == str(tmp_path / "t.jinja")


def test_the_builtin_chat_model_brings_its_parser_unless_the_file_sets_one():
    assert _model().serving.tool_call_parser == "hermes"
    assert _model().serving.auto_tool_choice is True
    assert _model(tool_call_parser=None).serving.tool_call_parser is None
    assert _model(tool_call_parser="llama3_json").serving.tool_call_parser == "llama3_json"
    dumped = _model(tool_call_parser=None).model_dump()
    assert ModelConfig.model_validate(dumped).serving.tool_call_parser is None, "a dumped config validates again"
    local = ModelConfig.model_validate({"name": "x", "source": "/models/mine"})
    assert local.serving.tool_call_parser is None


def test_an_embedding_model_takes_no_serving_options():
    with pytest.raises(Exception, match="embed model serves no chat"):
        ModelConfig.model_validate({"name": "e", "task": "embed", "source": "builtin:all-minilm-l6-v2",
                                    "serving": {"tool_call_parser": "hermes"}})
    ModelConfig.model_validate({"name": "e", "task": "embed", "source": "builtin:all-minilm-l6-v2"})


# ---- the builtin chat template ------------------------------------------------------------------------------

# SmolLM2-135M-Instruct's own chat template (from its GGUF), which renders no tools.
SMOLLM2_OWN = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
               "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
               "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{% endif %}")


def _render(template: str, **context) -> str:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template).render(**context)


@pytest.mark.parametrize("messages", [
    [], [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}],
])
@pytest.mark.parametrize("prompt", [True, False])
def test_a_conversation_without_tools_renders_exactly_as_the_models_own_template(messages, prompt):
    assert _render(CHATML_TOOLS, messages=messages, add_generation_prompt=prompt, tools=None) == \
        _render(SMOLLM2_OWN, messages=messages, add_generation_prompt=prompt)


def test_tools_calls_and_results_render_in_the_format_the_hermes_parser_reads():
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "1", "content": "sunny"}]
    text = _render(CHATML_TOOLS, messages=messages, add_generation_prompt=True, tools=[WEATHER])
    assert text.startswith(f"<|im_start|>system\n{SMOLLM2_SYSTEM}\n\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # What the template shows the model as a call is what vLLM's hermes parser reads back.
    assert Hermes2ProToolParser.tool_call_regex.findall(call)


# ---- the gateway's reading of the agent APIs ----------------------------------------------------------------

def test_a_responses_body_is_read_for_limits_quotas_and_tools():
    parsed = parse(ENDPOINTS["responses"], {"model": "m", "input": [{"role": "user", "content": "hi"}] * 2,
                                 "max_output_tokens": "500", "stream": "true", "tools": [
                                     {"type": "function", "name": "f", "parameters": {"type": "object"}}]})
    assert (parsed.max_tokens, parsed.stream, len(parsed.messages), parsed.tool_choice) == (500, True, 2, "auto")
    assert parsed.body["max_output_tokens"] == 500, "forwarded as the value the limits were checked on"


@pytest.mark.parametrize("field, value", [("previous_response_id", "resp_1"), ("background", True)])
def test_responses_state_is_refused_naming_the_field(field, value):
    extra = {"store": True} if field == "background" else {}
    with pytest.raises(ApiError) as refused:
        parse(ENDPOINTS["responses"], {"model": "m", "input": "hi", field: value, **extra})
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, field, "unsupported_parameter")


def test_a_messages_body_reads_as_the_chat_request_it_becomes():
    body = {"model": "m", "max_tokens": 7, "system": "s", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "f"}}
    parsed = parse(ENDPOINTS["messages"], body)
    assert (parsed.max_tokens, parsed.tool_choice, len(parsed.tools)) == (7, "named", 1)
    assert parse(ENDPOINTS["messages"], {**body, "tool_choice": {"type": "any"}}).tool_choice == "required"
    with pytest.raises(ApiError) as refused:
        parse(ENDPOINTS["messages"], {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert refused.value.status == 400 and "max_tokens" in str(refused.value.body())


@pytest.mark.parametrize("endpoint, body", [
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "required"}),
    ("responses", {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}]}),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                  "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
])
def test_tools_on_a_model_without_a_parser_get_a_400_naming_the_config_field(endpoint, body):
    parsed = parse(ENDPOINTS[endpoint], {"model": "chat", **body})
    with pytest.raises(ApiError) as refused:
        check_serving(_model(tool_call_parser=None), parsed)
    assert refused.value.status == 400 and "serving.tool_call_parser" in refused.value.message
    check_serving(_model(), parsed)  # the builtin's own parser serves them
    none = parse(ENDPOINTS[endpoint], {"model": "chat", **body, "tool_choice": {"type": "none"} if endpoint == "messages"
                            else "none"})
    check_serving(_model(tool_call_parser=None), none)  # tools the model may not call: fine


def test_auto_tool_choice_turned_off_names_its_field_and_the_forced_choices_still_work():
    model = _model(enable_auto_tool_choice=False)
    chat = {"model": "chat", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    with pytest.raises(ApiError) as refused:
        check_serving(model, parse(ENDPOINTS["chat"], chat))
    assert refused.value.param == "tool_choice" and "serving.enable_auto_tool_choice" in refused.value.message
    check_serving(model, parse(ENDPOINTS["chat"], {**chat, "tool_choice": "required"}))


def test_an_embedding_model_refuses_the_agent_endpoints():
    embed = ModelConfig.model_validate({"name": "e", "task": "embed", "source": "builtin:all-minilm-l6-v2"})
    with pytest.raises(ApiError) as refused:
        check_serving(embed, parse(ENDPOINTS["responses"], {"model": "e", "input": "x"}))
    assert refused.value.code == "model_not_supported"


# ---- wire formats ----------------------------------------------------------------------------------------------

def _sse(kind: str, data: str) -> str:
    return f"event: {kind}\ndata: {data}\n\n"


def test_responses_events_give_token_deltas_and_the_final_usage():
    delta = ENDPOINTS["responses"].wire.read_event(_sse("response.output_text.delta", '{"type":"response.output_text.delta","delta":"a"}'))
    assert delta.token and delta.prompt_tokens is None
    done = ENDPOINTS["responses"].wire.read_event(_sse("response.completed", '{"type":"response.completed","response":'
                                        '{"usage":{"input_tokens":12,"output_tokens":5}}}'))
    assert (done.prompt_tokens, done.completion_tokens, done.token) == (12, 5, False)
    error = ENDPOINTS["responses"].wire.read_event(_sse("error", '{"type":"error","code":"x","message":"boom"}'))
    assert error.error == {"message": "boom", "code": "x"}


def test_messages_events_give_prompt_tokens_first_and_completion_tokens_last():
    start = ENDPOINTS["messages"].wire.read_event(_sse("message_start", '{"type":"message_start","message":{"usage":'
                                        '{"input_tokens":9,"output_tokens":0}}}'))
    assert (start.prompt_tokens, start.completion_tokens) == (9, None)
    assert ENDPOINTS["messages"].wire.read_event(_sse("content_block_delta", '{"type":"content_block_delta"}')).token
    end = ENDPOINTS["messages"].wire.read_event(_sse("message_delta", '{"type":"message_delta","usage":{"output_tokens":4}}'))
    assert end.completion_tokens == 4
    assert ENDPOINTS["messages"].wire.read_event("event: ping\ndata: not json\n\n") == ENDPOINTS["messages"].wire.read_event("")


def test_a_typed_stream_cut_short_is_settled_at_the_tokens_produced_then_at_the_engines_usage():
    """The replica reads the Messages stream (its prompt first, its completion last) beside the engine's
    running count; the gateway's account follows that count, then takes the stream's end."""
    engine = EngineStream(ENDPOINTS["messages"].wire, prompt=9)
    usage, tokens = Usage(), []
    account = StreamAccount(usage, tokens.append)
    account.take(engine.chunk(_sse("message_start", '{"type":"message_start","message":{"usage":{"input_tokens":9}}}')))
    for _ in range(3):
        account.take(engine.chunk(_sse("content_block_delta", '{"type":"content_block_delta"}')))
    assert (usage.prompt_tokens, usage.completion_tokens) == (9, 3), "cut here: the tokens produced so far"
    account.take(engine.chunk(_sse("content_block_delta", '{"type":"content_block_delta"}')))
    account.take(engine.chunk(_sse("message_delta", '{"type":"message_delta","usage":{"output_tokens":4}}')))
    account.take(engine.end())
    assert (usage.prompt_tokens, usage.completion_tokens) == (9, 4) and len(tokens) == 4


def test_whole_replies_usage_in_every_shape():
    assert whole_usage({"usage": {"prompt_tokens": 3, "completion_tokens": 2}}) == (3, 2)
    assert whole_usage({"usage": {"input_tokens": 3, "output_tokens": 2, "cache_read_input_tokens": 4}}) == (7, 2)
    assert whole_usage({"output": []}) is None


def test_errors_in_anthropics_shape():
    assert anthropic_error({"error": {"message": "no", "code": "rate_limit_exceeded"}}, 429) == \
        {"type": "error", "error": {"type": "rate_limit_error", "message": "no"}}
    assert anthropic_error({"detail": "x"}, 403)["error"]["type"] == "permission_error"
    assert ENDPOINTS["messages"].wire.error_event("broke", 503, "stream_interrupted").startswith("event: error\ndata: ")
    assert '"type": "overloaded_error"' in ENDPOINTS["messages"].wire.error_event("broke", 503, "stream_interrupted")
    assert ENDPOINTS["chat"].wire.error_event("broke", 503, "stream_interrupted").startswith('data: {"error"')
    assert '"code": "stream_interrupted"' in ENDPOINTS["responses"].wire.error_event("broke", 503, "stream_interrupted")


# ---- reasoning -------------------------------------------------------------------------------------------------

def test_a_reasoning_models_thinking_is_also_sent_as_reasoning_content():
    import asyncio

    from shunter.engine import _name_reasoning_content, _reasoning_content_chunks

    body = {"choices": [{"index": 0, "message": {"content": "4", "reasoning": "2 and 2"}}]}
    assert _name_reasoning_content(body, "message")
    assert body["choices"][0]["message"]["reasoning_content"] == "2 and 2"

    async def vllm_stream():
        yield 'data: {"choices":[{"index":0,"delta":{"reasoning":"hm"}}],"usage":{"completion_tokens":1}}\n\n'
        yield 'data: {"choices":[{"index":0,"delta":{"content":"4"}}]}\n\n'
        yield "data: [DONE]\n\n"

    async def relayed():
        return [chunk async for chunk in _reasoning_content_chunks(vllm_stream())]

    first, second, done = asyncio.run(relayed())
    assert first == ('data: {"choices":[{"index":0,"delta":{"reasoning":"hm","reasoning_content":"hm"}}],'
                     '"usage":{"completion_tokens":1}}\n\n'), "usage stays the last key (the relay reads it there)"
    assert second == 'data: {"choices":[{"index":0,"delta":{"content":"4"}}]}\n\n' and done == "data: [DONE]\n\n"


# ---- routing and tiers read the agent APIs' prompts --------------------------------------------------------------

def test_agent_api_prompts_get_prefix_keys_that_share_their_common_beginning():
    from shunter.routing.prefix import prefix_key, render_prompt
    from shunter.routing.tiers import features

    system = "You are a careful assistant who reads the whole document before answering. " * 8
    for endpoint, make in [
        ("responses", lambda q: {"instructions": system, "input": [{"role": "user", "content": q}]}),
        ("messages", lambda q: {"system": system, "max_tokens": 5, "messages": [{"role": "user", "content": q}]}),
    ]:
        one, two = (prefix_key(render_prompt(endpoint, make(q * 12)), 16) for q in ("What is 2+2? ", "Colours? "))
        assert len(one.keys) >= 5 and one.keys[:5] == two.keys[:5], endpoint  # the shared instructions
        assert one.keys[-1] != two.keys[-1], endpoint  # then the questions
        seen = features(make("Prove that the sum of two even numbers is even."))
        assert (seen.turns, seen.prompt_tokens > len(system) // 4) == (1, True), endpoint  # instructions and input
    assert render_prompt("responses", {"input": "hello"}) == "<user>hello"
    assert features({"input": "hi", "max_output_tokens": 7}).max_tokens == 7
