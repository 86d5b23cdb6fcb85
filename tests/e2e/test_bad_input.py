"""Bad input gets an OpenAI-shaped 4xx, never a 500 or a hang, and the platform keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .live import CAPITAL_QUESTION, CHAT_MODEL, EMBED_MODEL, assert_capital

HI = [{"role": "user", "content": "hi"}]


def _post(app, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{app.v1}{path}", timeout=60, **kwargs)


def _assert_openai_error(resp: httpx.Response, status: int, param: str | None = None, in_message: str = ""):
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and isinstance(err["type"], str)
    assert "pydantic" not in err["message"] and "input_value" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert in_message.lower() in err["message"].lower(), err
    return err


RAW_BODIES = {
    "malformed json": (b'{"model": "smollm2-135m-instruct", ', 400, None, "not valid JSON"),
    "non-utf8 json": (b'{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":"\xff\xfe"}]}', 400,
                      None, "UTF-8"),
    "json array": (b"[1, 2, 3]", 400, None, "JSON object"),
    "empty body": (b"", 400, None, "empty"),
    "nesting past the JSON parser's depth": (b'{"model": "smollm2-135m-instruct", "messages": ' + b"[" * 5000
                                             + b"]" * 5000 + b"}", 400, None, "JSON"),
    "nesting past the gateway's depth": (b'{"model": "smollm2-135m-instruct", "messages": ' + b"[" * 100
                                         + b"]" * 100 + b"}", 400, None, "deeper"),
    "integer of 5000 digits": (b'{"model": "smollm2-135m-instruct", "max_tokens": 1' + b"0" * 5000 + b"}", 400,
                               None, "JSON"),
}


@pytest.mark.parametrize("case", list(RAW_BODIES))
def test_unparseable_bodies(live_app, case):
    raw, status, param, text = RAW_BODIES[case]
    resp = _post(live_app, "/chat/completions", content=raw, headers={"content-type": "application/json"})
    _assert_openai_error(resp, status, param, text)


CHAT_BODIES = {
    "missing model": ({"messages": HI}, 400, "model", "model"),
    "model not a string": ({"model": 7, "messages": HI}, 400, "model", "string"),
    "unknown model": ({"model": "gpt-17", "messages": HI}, 404, "model", "does not exist"),
    "chat to an embedding model": ({"model": EMBED_MODEL, "messages": HI}, 400, "model", "embedding model"),
    "missing messages": ({"model": CHAT_MODEL}, 400, "messages", "messages"),
    "messages not a list": ({"model": CHAT_MODEL, "messages": "hi"}, 400, "messages", "list"),
    "empty message list": ({"model": CHAT_MODEL, "messages": []}, 400, None, "empty"),
    "max_tokens zero": ({"model": CHAT_MODEL, "messages": HI, "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    "max_tokens negative": ({"model": CHAT_MODEL, "messages": HI, "max_tokens": -3}, 400, "max_tokens", ""),
    # configs/local.yaml: a 2048-token context under the platform's default limit of 4096 generated tokens.
    "max_tokens beyond context": ({"model": CHAT_MODEL, "messages": HI, "max_tokens": 3000}, 400, "max_tokens",
                                  "max_model_len"),
    "max_tokens beyond the platform limit": ({"model": CHAT_MODEL, "messages": HI, "max_tokens": 100_000}, 400,
                                             "max_tokens", "at most 4096"),
    "max_tokens mistyped": ({"model": CHAT_MODEL, "messages": HI, "max_tokens": "ten"}, 400, "max_tokens", ""),
    "temperature too high": ({"model": CHAT_MODEL, "messages": HI, "temperature": 7}, 400, "temperature", ""),
    "temperature negative": ({"model": CHAT_MODEL, "messages": HI, "temperature": -1}, 400, "temperature", ""),
    "top_p zero": ({"model": CHAT_MODEL, "messages": HI, "top_p": 0}, 400, "top_p", ""),
    "top_p above one": ({"model": CHAT_MODEL, "messages": HI, "top_p": 1.5}, 400, "top_p", ""),
    "json_schema format without a schema": ({"model": CHAT_MODEL, "messages": HI,
                                             "response_format": {"type": "json_schema"}}, 400, "response_format", ""),
    "tool_choice without tools": ({"model": CHAT_MODEL, "messages": HI, "tool_choice": "required"}, 400,
                                  "tool_choice", "tools"),
    "stream_options without stream": ({"model": CHAT_MODEL, "messages": HI, "stream_options": {"include_usage": True}},
                                      400, "stream_options", "stream"),
    "malformed content part": ({"model": CHAT_MODEL, "messages": [{"role": "user", "content": [{"type": "nope"}]}]},
                               400, None, ""),
    "prompt longer than context": ({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "word " * 3000}]},
                                   400, None, "maximum context length"),
}


@pytest.mark.parametrize("case", list(CHAT_BODIES))
def test_bad_chat_requests(live_app, case):
    body, status, param, text = CHAT_BODIES[case]
    _assert_openai_error(_post(live_app, "/chat/completions", json=body), status, param, text)


def test_bad_streaming_request_fails_before_the_stream(live_app):
    """A streaming request that is invalid gets a JSON error with its status, not an event stream."""
    resp = _post(live_app, "/chat/completions", json={"model": CHAT_MODEL, "messages": HI, "max_tokens": 0,
                                                      "stream": True})
    _assert_openai_error(resp, 400, "max_tokens")


@pytest.mark.parametrize("prompt", ["", ["Paris is", ""]], ids=["empty", "empty in a batch"])
def test_an_empty_prompt_to_a_completion_stream_fails_before_the_stream(live_app, prompt):
    """vLLM finds an empty prompt only once it generates, which in a stream is an error event inside a 200;
    the replica renders a stream's prompts first, so the client gets the 400 it would get without `stream`."""
    resp = _post(live_app, "/completions", json={"model": CHAT_MODEL, "prompt": prompt, "max_tokens": 4,
                                                 "stream": True})
    _assert_openai_error(resp, 400, "prompt", "empty")


def test_completions_and_embeddings_errors(live_app):
    _assert_openai_error(_post(live_app, "/completions", json={"model": CHAT_MODEL, "prompt": "x", "max_tokens": 0}),
                         400, "max_tokens")
    _assert_openai_error(_post(live_app, "/embeddings", json={"model": CHAT_MODEL, "input": "x"}), 400, "model",
                         "generative model")
    _assert_openai_error(_post(live_app, "/embeddings", json={"model": EMBED_MODEL, "input": "word " * 600}), 400,
                         None, "maximum context length")
    _assert_openai_error(_post(live_app, "/embeddings", json={"model": EMBED_MODEL}), 400, "input")
    _assert_openai_error(_post(live_app, "/completions", json={"model": CHAT_MODEL, "prompt": "", "max_tokens": 4}),
                         400, "prompt")


def test_body_over_the_limit_is_413(live_app):
    limit = 1_048_576  # configs/local.yaml gateway.max_body_bytes
    body = json.dumps({"model": CHAT_MODEL, "prompt": "a" * (limit + 10)})
    _assert_openai_error(_post(live_app, "/completions", content=body, headers={"content-type": "application/json"}),
                         413, None, "limit")


def test_body_over_the_limit_without_content_length_is_413(live_app):
    """A chunked upload declares no length; the gateway counts bytes as they arrive."""
    def chunks():
        yield b'{"model": "smollm2-135m-instruct", "prompt": "'
        for _ in range(20):
            yield b"a" * 65536
        yield b'"}'

    resp = _post(live_app, "/completions", content=chunks(), headers={"content-type": "application/json"})
    _assert_openai_error(resp, 413, None, "limit")


def test_unknown_route_and_method_are_openai_shaped(live_app):
    _assert_openai_error(httpx.get(f"{live_app.v1}/nothing-here"), 404)
    _assert_openai_error(httpx.get(f"{live_app.v1}/chat/completions"), 405)


def test_official_client_raises_typed_errors(live_app):
    client = live_app.openai()
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=HI)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=CHAT_MODEL, messages=HI, temperature=5)
    assert info.value.body["param"] == "temperature"


def test_platform_still_serves_after_bad_input(live_app):
    resp = live_app.openai().chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": CAPITAL_QUESTION}], max_tokens=30,
        temperature=0)
    assert_capital(resp.choices[0].message.content, live_app.base_url)
