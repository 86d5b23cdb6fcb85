"""Hostile clients, round two (issue 36), on the keyed app with real engines and real keys: nothing one key
sends can take a model down for the others (open a breaker, draw a 5xx), see another key's prompts through
the prefix cache, push more work through one embeddings request than the limits allow, or leave behind a
name the admin API cannot remove.

The keyed app (tests/e2e/keyed_app.py) is shared with the other `test_api_keys_*` modules: one app start.
Breaker movement is read from the admin API's replica list (`failures`: replica failures each gateway
recorded), asked often enough to hear from both gateways. A client that leaves (item 6) is
tests/e2e/test_api_keys_disconnect.py's; the agent APIs' SDK gaps (item 7) tests/e2e/test_api_keys_agents.py's.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from .keyed_app import (
    ADMIN,
    FULL,
    MAX_EMBEDDING_INPUTS,
    ORG_ONE,
    ORG_TWO,
    TIMEOUT_S,
    replica_failures,
    served_chat,
)
from .live import CHAT_MODEL, EMBED_MODEL

pytestmark = pytest.mark.own_app

PREFIX_HEADER = "x-shunter-prefix-predicted"


@pytest.fixture(scope="module")
def app(keyed_app_url) -> str:
    return keyed_app_url


def post(app: str, path: str, body: Any, key: str = FULL, raw: bytes | None = None) -> httpx.Response:
    """`body` sent as Python's JSON encoder writes it (non-ASCII and lone surrogates as \\u escapes, as a
    hostile client's would), or `raw` bytes."""
    content = raw if raw is not None else json.dumps(body).encode("ascii")
    return httpx.post(f"{app}{path}", content=content, timeout=TIMEOUT_S,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def assert_client_error(resp: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text[:400])
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "code"}, error
    return error


# ---- 1. the breaker counts only the replica's faults -------------------------------------------------

USER = {"role": "user", "content": "Say hi."}
# Inputs that make vLLM's Responses layer raise (an item without the content it indexes): answered 500 by
# vLLM's server, and counted against the replica once.
BREAKING_RESPONSES = [
    {"input": [USER, {"role": "assistant", "content": []}, USER]},
    {"input": [USER, {"type": "message", "role": "assistant", "content": []}, USER]},
    {"input": [USER, {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
               USER]},
]


@pytest.mark.parametrize("stream", [False, True])
def test_inputs_that_break_vllms_serving_layer_are_400s_that_move_no_breaker(app, stream):
    before = replica_failures(app)
    answers = []
    for body in BREAKING_RESPONSES * 2:  # past the breaker's failures in a row, were they counted
        resp = post(app, "/v1/responses", {"model": CHAT_MODEL, "max_output_tokens": 4, "stream": stream, **body})
        answers.append(resp.status_code)
        assert resp.status_code < 500, (body, resp.status_code, resp.text[:400])
        if resp.status_code == 200 and stream:  # a stream that started must not carry the engine's 5xx
            assert '"code":5' not in resp.text.replace(" ", "") and "server_error" not in resp.text, resp.text[-600:]
        served_chat(app, ORG_ONE)  # another key is served throughout
    print(f"\nanswers: {answers}")
    assert replica_failures(app) == before, "a client's request was counted as a replica failure"


# ---- 2. no 5xx from any client byte --------------------------------------------------------------------

LONE = "\ud800"
SURROGATE_BODIES = [
    ("/v1/responses", {"model": CHAT_MODEL, "input": "hi", "max_output_tokens": 2, "metadata": {"k": LONE}}),
    ("/v1/responses", {"model": CHAT_MODEL, "input": "hi", "max_output_tokens": 2, "stream": True,
                       "metadata": {"k": LONE}}),
    ("/v1/chat/completions", {"model": CHAT_MODEL, "messages": [USER], "max_tokens": 2, "logit_bias": {LONE: 1}}),
    ("/v1/chat/completions", {"model": CHAT_MODEL, "messages": [USER], "max_tokens": 2, "vllm_xargs": {LONE: 1}}),
    ("/v1/chat/completions", {"model": CHAT_MODEL, "messages": [USER], "max_tokens": 2, "stop": ["ok", LONE]}),
    ("/v1/chat/completions", {"model": CHAT_MODEL, "messages": [{"role": "user", "content": f"x{LONE}y"}],
                              "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"model": CHAT_MODEL, "messages": [USER], "max_tokens": 2, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            LONE: {"type": "string"}}}}}]}),
    ("/v1/completions", {"model": CHAT_MODEL, "prompt": [f"a{LONE}"], "max_tokens": 2}),
    ("/v1/embeddings", {"model": EMBED_MODEL, "input": [LONE]}),
    ("/v1/messages", {"model": CHAT_MODEL, "max_tokens": 2, "messages": [USER], "metadata": {"user_id": LONE}}),
    ("/v1/messages", {"model": CHAT_MODEL, "max_tokens": 2, "system": LONE, "messages": [USER], "stream": True}),
]


@pytest.mark.parametrize("path, body", SURROGATE_BODIES)
def test_a_lone_surrogate_anywhere_is_a_400_that_echoes_nothing_unencodable(app, path, body):
    resp = post(app, path, body)
    assert resp.status_code == 400, (resp.status_code, resp.text[:400])
    resp.content.decode("utf-8")  # the answer itself is valid UTF-8
    error = resp.json()["error"]  # OpenAI's shape, and Anthropic's for /v1/messages
    assert "surrogate" in error["message"], error


def test_bytes_that_are_not_utf8_or_odd_code_points_never_get_a_5xx(app):
    assert_client_error(post(app, "/v1/chat/completions", None, raw=b'{"model": "m", "messages": "\xff\xfe"}'))
    odd = "\u0000\uffff\ufffe\U0010ffff\u200b\U0001F600"
    resp = post(app, "/v1/chat/completions", {"model": CHAT_MODEL, "max_tokens": 2,
                                              "messages": [{"role": "user", "content": odd}], "stop": [odd]})
    assert resp.status_code in (200, 400), (resp.status_code, resp.text[:300])


# ---- 3. prompt caches isolated by tenant ---------------------------------------------------------------

def _cached(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    details = resp.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def test_one_keys_cached_prompt_is_invisible_to_another_but_shared_within_its_cache_group(app):
    # About 180 tokens: one whole 128-token KV block the engine can cache, within the app's prompt limit.
    words = " ".join(f"w{i}" for i in range(45))
    body = {"model": CHAT_MODEL, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": f"{uuid.uuid4().hex} {words}"}, USER]}
    first = post(app, "/v1/chat/completions", body, key=ORG_ONE)
    assert _cached(first) == 0
    again = post(app, "/v1/chat/completions", body, key=ORG_ONE)
    assert _cached(again) >= 128, "the positive control: the key's own prompt is cached"
    group = post(app, "/v1/chat/completions", body, key=ORG_TWO)
    assert _cached(group) >= 128, "a key of the same cache group shares it"
    other = post(app, "/v1/chat/completions", body, key=FULL)
    assert _cached(other) == 0, "another tenant learns nothing of the prompt from cached_tokens"
    predicted = other.headers.get(PREFIX_HEADER)
    assert predicted is None or float(predicted.split()[0]) == 0.0, predicted
    # The client's own cache_salt splits its cache further; it can never join another's.
    salted = post(app, "/v1/chat/completions", {**body, "cache_salt": "mine"}, key=ORG_ONE)
    assert _cached(salted) == 0


# ---- 4. embeddings bounded ------------------------------------------------------------------------------

def test_embeddings_past_the_input_bound_or_the_prompt_limit_in_sum_are_400s(app):
    error = assert_client_error(post(app, "/v1/embeddings", {"model": EMBED_MODEL,
                                                             "input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}))
    assert (error["code"], error["param"]) == ("too_many_inputs", "input"), error
    # Each input is far below the prompt limit; together they are past it: the limit is the request's.
    many = [f"sentence number {i} about the weather" for i in range(MAX_EMBEDDING_INPUTS)]
    error = assert_client_error(post(app, "/v1/embeddings", {"model": EMBED_MODEL, "input": many}))
    assert error["code"] == "prompt_too_long", error
    resp = post(app, "/v1/embeddings", {"model": EMBED_MODEL, "input": many[:8]})
    assert resp.status_code == 200 and len(resp.json()["data"]) == 8, resp.text[:300]
    error = assert_client_error(post(app, "/v1/completions", {"model": CHAT_MODEL, "max_tokens": 1,
                                                              "prompt": [f"prompt {i} " * 10 for i in range(30)]}))
    assert error["code"] == "prompt_too_long", error


# ---- 5. every name the admin API accepts it can remove -------------------------------------------------

@pytest.mark.parametrize("name", ["sec2/slash", "a:b", "..", "x%2Fy", "ok name"])
def test_an_adapter_name_the_routes_cannot_carry_is_refused_at_add(app, name):
    resp = httpx.post(f"{app}/admin/models/{CHAT_MODEL}/adapters", json={"name": name, "source": "/nonexistent"},
                      headers={"Authorization": f"Bearer {ADMIN}"}, timeout=TIMEOUT_S)
    error = assert_client_error(resp)
    assert error["param"] == "name", error


# ---- 8. a sane dtype by CPU ------------------------------------------------------------------------------

def test_each_replica_runs_the_dtype_its_cpu_runs_fast_and_says_so(app):
    from shunter.cpu_dtype import node_cpu_flags, resolve_dtype

    expected, why = resolve_dtype("auto", "cpu", node_cpu_flags())  # the replicas run on this machine
    details = httpx.get(f"{app}/ready", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=TIMEOUT_S).json()
    for model in (CHAT_MODEL, EMBED_MODEL):
        assert details["models"][model]["dtype"] == expected, (why, details["models"][model])
