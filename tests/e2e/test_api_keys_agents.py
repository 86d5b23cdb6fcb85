"""The agent APIs (Responses, Anthropic Messages) behind the same door as chat, on the keyed app
(tests/e2e/keyed_app.py): a key not allowed the model is refused before anything runs, in each API's
error shape, and a key's token quota is settled at the tokens the engine really used, for whole replies
and streams alike, until it refuses with a 429. Replies are shaped as the official APIs send them where
their SDKs notice: a Responses stream cut short ends with `response.incomplete`, and a whole Messages reply
carries `stop_sequence` and usage's cache counts, null or not."""

from __future__ import annotations

import anthropic
import openai
import pytest

from shunter.auth import key_id

from .keyed_app import (
    AGENTS,
    AGENTS_TOKENS_PER_MINUTE,
    EMBED_ONLY,
    FULL,
    JOBS,
    MAX_PROMPT_TOKENS,
    MAX_TOKENS,
    TIMEOUT_S,
)
from .live import CHAT_MODEL, scrape_until

pytestmark = pytest.mark.own_app

HELLO = [{"role": "user", "content": "Say hello."}]
STORY = "Tell me a long story about a dragon and a knight."  # always longer than 4 tokens


@pytest.fixture(scope="module")
def app(keyed_app_url) -> str:
    return keyed_app_url


def _openai(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=TIMEOUT_S)


def _anthropic(base: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=TIMEOUT_S)


def test_a_key_not_allowed_the_model_is_refused_by_every_agent_api(app):
    with pytest.raises(openai.PermissionDeniedError) as responses:
        _openai(app, EMBED_ONLY).responses.create(model=CHAT_MODEL, input="hi", max_output_tokens=4)
    assert responses.value.body["code"] == "model_not_allowed"
    with pytest.raises(openai.PermissionDeniedError):
        _openai(app, EMBED_ONLY).responses.create(model=CHAT_MODEL, input="hi", max_output_tokens=4, stream=True)
    with pytest.raises(anthropic.PermissionDeniedError) as messages:  # the key as Anthropic's clients send it
        _anthropic(app, EMBED_ONLY).messages.create(model=CHAT_MODEL, max_tokens=4, messages=HELLO)
    assert messages.value.body["error"]["type"] == "permission_error"
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        _anthropic(app, "sk-not-a-key-0123456789").messages.create(model=CHAT_MODEL, max_tokens=4, messages=HELLO)
    assert wrong.value.body["type"] == "error"


def test_limits_hold_for_the_agent_apis_naming_their_fields(app):
    """Tool definitions count toward the prompt limit: a short question with a large tool is too long."""
    long = "word " * 400
    with pytest.raises(openai.BadRequestError) as prompt:
        _openai(app, FULL).responses.create(model=CHAT_MODEL, input=long, max_output_tokens=4)
    assert (prompt.value.body["code"], prompt.value.body["param"]) == ("prompt_too_long", "input")
    with pytest.raises(openai.BadRequestError) as output:
        _openai(app, FULL).responses.create(model=CHAT_MODEL, input="hi", max_output_tokens=str(MAX_TOKENS + 1))
    assert (output.value.body["code"], output.value.body["param"]) == ("max_tokens_too_large", "max_output_tokens")
    big_tool = {"name": "lookup", "description": long, "input_schema": {"type": "object"}}
    with pytest.raises(anthropic.BadRequestError) as tools:
        _anthropic(app, FULL).messages.create(model=CHAT_MODEL, max_tokens=4, messages=HELLO, tools=[big_tool])
    assert tools.value.body["error"]["type"] == "invalid_request_error"
    assert f"at most {MAX_PROMPT_TOKENS} prompt tokens" in tools.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as many:
        _anthropic(app, FULL).messages.create(model=CHAT_MODEL, max_tokens=MAX_TOKENS + 1, messages=HELLO)
    assert "max_tokens" in many.value.body["error"]["message"]


def test_a_keys_quota_is_settled_at_real_usage_then_refuses_each_api(app):
    used = 0
    reply = _openai(app, AGENTS).responses.create(model=CHAT_MODEL, input="Say hello.", max_output_tokens=4)
    used += reply.usage.input_tokens + reply.usage.output_tokens
    with _openai(app, AGENTS).responses.stream(model=CHAT_MODEL, input="Say hi.", max_output_tokens=4) as stream:
        final = list(stream)[-1].response  # response.incomplete when cut at 4 tokens: no get_final_response()
    used += final.usage.input_tokens + final.usage.output_tokens
    message = _anthropic(app, AGENTS).messages.create(model=CHAT_MODEL, max_tokens=4, messages=HELLO)
    used += message.usage.input_tokens + message.usage.output_tokens
    with _anthropic(app, AGENTS).messages.stream(model=CHAT_MODEL, max_tokens=4, messages=HELLO) as stream:
        streamed = stream.get_final_message()
    used += streamed.usage.input_tokens + streamed.usage.output_tokens
    from tests.integration.local_app import kept_metrics_url

    labels = {"key_id": key_id(AGENTS)}
    text = scrape_until(kept_metrics_url(), [("ray_shunter_key_tokens_total", labels)], at_least=used)
    from .live import metric_total

    assert metric_total(text, "ray_shunter_key_tokens_total", **labels) == used, "settled at what the engine used"
    # Past the budget (each gateway holds half of it), each API answers a 429 in its own shape.
    refusals: dict[str, Exception] = {}
    for _ in range(40):
        if "responses" not in refusals:
            try:
                _openai(app, AGENTS).responses.create(model=CHAT_MODEL, input="Say hello.", max_output_tokens=8)
            except openai.RateLimitError as exc:
                refusals["responses"] = exc
        if "messages" not in refusals:
            try:
                _anthropic(app, AGENTS).messages.create(model=CHAT_MODEL, max_tokens=8, messages=HELLO)
            except anthropic.RateLimitError as exc:
                refusals["messages"] = exc
        if len(refusals) == 2:
            break
    assert set(refusals) == {"responses", "messages"}, f"{AGENTS_TOKENS_PER_MINUTE} tokens a minute never ran out"
    assert refusals["responses"].body["code"] == "rate_limit_exceeded"
    assert refusals["messages"].body["error"]["type"] == "rate_limit_error"
    assert int(refusals["messages"].response.headers["retry-after"]) >= 1


def test_a_responses_stream_cut_by_max_output_tokens_ends_as_openais_does(app):
    """OpenAI ends a stream cut by `max_output_tokens` with `response.incomplete` (vLLM sends
    `response.completed` with status incomplete); the whole reply says the same."""
    client = _openai(app, FULL)
    kinds = [event.type for event in client.responses.create(model=CHAT_MODEL, input=STORY, max_output_tokens=4,
                                                              stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete", kinds
    assert "response.completed" not in kinds, kinds
    with client.responses.stream(model=CHAT_MODEL, input=STORY, max_output_tokens=4) as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete", last.type
    assert last.response.status == "incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text and last.response.usage.output_tokens == 4
    whole = client.responses.create(model=CHAT_MODEL, input=STORY, max_output_tokens=4)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"


def test_a_whole_message_carries_the_null_fields_anthropics_does(app):
    """Anthropic's Message always carries `stop_sequence` (null unless one matched) and usage's cache
    counts (null or a count): present as keys in the raw JSON, not just defaulted by the SDK."""
    raw = _anthropic(app, FULL).messages.with_raw_response.create(model=CHAT_MODEL, max_tokens=4,
                                                                 messages=[{"role": "user", "content": STORY}])
    body = raw.http_response.json()
    assert body["type"] == "message" and body["stop_reason"] == "max_tokens", body
    assert "stop_sequence" in body and body["stop_sequence"] is None, body
    usage = body["usage"]
    for key in ("cache_creation_input_tokens", "cache_read_input_tokens"):
        assert key in usage and (usage[key] is None or isinstance(usage[key], int)), usage
    assert usage["input_tokens"] > 0 and usage["output_tokens"] == 4, usage
    assert raw.parse().stop_sequence is None


def test_a_request_gets_its_keys_class_and_may_lower_but_never_raise_it(app):
    """Priority classes at the door (issue 38): the class is answered in x-shunter-priority; a class the key
    may not use is a 403 in each API's own envelope, never a silent change; an unknown one a 400."""
    jobs, full = _openai(app, JOBS), _openai(app, FULL)
    asked = {"model": CHAT_MODEL, "messages": HELLO, "max_tokens": 2}
    served = jobs.chat.completions.with_raw_response.create(**asked)
    assert served.headers["x-shunter-priority"] == "batch"
    lowered = full.chat.completions.with_raw_response.create(**asked, service_tier="flex")
    assert lowered.headers["x-shunter-priority"] == "batch"
    with pytest.raises(openai.PermissionDeniedError) as denied:
        jobs.chat.completions.create(**asked, service_tier="priority")
    assert denied.value.code == "priority_class_not_allowed"
    with pytest.raises(openai.PermissionDeniedError):
        jobs.responses.create(model=CHAT_MODEL, input="hi", max_output_tokens=4,
                              extra_headers={"x-shunter-priority": "interactive"})
    with pytest.raises(anthropic.PermissionDeniedError) as denied_messages:
        _anthropic(app, JOBS).messages.create(model=CHAT_MODEL, max_tokens=2, messages=HELLO,
                                              extra_headers={"x-shunter-priority": "standard"})
    assert denied_messages.value.body["type"] == "error"
    with pytest.raises(openai.BadRequestError) as unknown:
        full.chat.completions.create(**asked, extra_headers={"x-shunter-priority": "urgent"})
    assert unknown.value.code == "unknown_priority_class"
    with pytest.raises(openai.BadRequestError):
        full.chat.completions.create(**asked, service_tier="scale")
