"""Client bytes that no valid text holds: a lone UTF-16 surrogate escaped anywhere in a JSON body (a key
or a value) is the client's 400 at the door, never a 500 further in; error messages quoting a client's
value stay encodable. No Ray, no engine."""

from __future__ import annotations

import json

import pytest

from shunter.deployments.gateway.request_body import _SURROGATE_ESCAPE, lone_surrogate_at
from shunter.errors import ApiError, error_body


@pytest.mark.parametrize("body, where", [
    ({"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages.0.content"),
    ({"metadata": {"k": "\udfff"}}, "metadata.k"),
    ({"logit_bias": {"\ud83d": 1}}, "logit_bias.\\ud83d"),  # a key: named by its escape
    ({"stop": ["ok", "\udc00"]}, "stop.1"),
])
def test_a_lone_surrogate_is_found_wherever_it_is(body, where):
    text = json.dumps(body)  # Python's encoder writes a surrogate as an escape, as hostile clients do
    assert _SURROGATE_ESCAPE.search(text)
    assert lone_surrogate_at(json.loads(text)) == where
    json.dumps(error_body(f"at {where}", 400, param=where), ensure_ascii=False).encode("utf-8")


def test_pairs_and_odd_but_valid_code_points_pass():
    body = {"messages": [{"role": "user", "content": "smile \U0001F600 \uffff \ufffe \u0000 \u200b"}]}
    assert lone_surrogate_at(json.loads(json.dumps(body))) is None  # a pair is escaped too, but is valid


def test_an_error_quoting_a_client_value_stays_encodable():
    body = ApiError(400, "unknown key '\ud800'", param="logit_bias.\udc00").body()
    encoded = json.dumps(body, ensure_ascii=False).encode("utf-8")
    assert b"\\\\ud800" in encoded and body["error"]["param"] == "logit_bias.\\udc00"
