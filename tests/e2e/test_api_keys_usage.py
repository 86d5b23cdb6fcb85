"""Usage and cost per tenant on the keyed app (tests/e2e/keyed_app.py; issue 38): the usage ledger, read
through GET /admin/usage, equals what the clients were told in their replies' `usage`, per key and model,
through both gateway replicas (each sends its records to the one ledger in batches), with the chat model's
pricing applied, times the batch class's price multiplier for what was served as flex. Clients are the official OpenAI SDK."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from shunter.auth import key_id

from .keyed_app import ADMIN, BATCH_PRICE_MULTIPLIER, EMBED_MODEL, LEDGER_A, LEDGER_B, PRICING, TIMEOUT_S
from .live import CHAT_MODEL

pytestmark = pytest.mark.own_app


def _client(app: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app}/v1", api_key=key, max_retries=0, timeout=TIMEOUT_S)


def _told(usage: Any, told: dict[str, int]) -> None:
    """Adds a reply's usage, as the client read it, to `told`."""
    told["requests"] += 1
    told["prompt_tokens"] += usage.prompt_tokens
    told["completion_tokens"] += getattr(usage, "completion_tokens", 0) or 0
    details = getattr(usage, "prompt_tokens_details", None)
    told["cached_tokens"] += (getattr(details, "cached_tokens", None) or 0) if details is not None else 0


def _usage(app: str, **params: str) -> httpx.Response:
    return httpx.get(f"{app}/admin/usage", params=params, headers={"Authorization": f"Bearer {ADMIN}"},
                     timeout=TIMEOUT_S)


def _rows_once_settled(app: str, expected_requests: int, **params: str) -> list[dict[str, Any]]:
    """The ledger's rows once `expected_requests` records arrived (the other gateway's come within its flush
    interval)."""
    deadline, rows = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        resp = _usage(app, **params)
        assert resp.status_code == 200, resp.text
        rows = resp.json()["data"]
        if sum(r["requests"] for r in rows) >= expected_requests:
            return rows
        time.sleep(0.5)
    raise AssertionError(f"the ledger holds fewer than {expected_requests} records: {rows}")


def _new() -> dict[str, int]:
    return {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}


def test_the_ledger_equals_what_each_tenant_was_told_with_its_cost(keyed_app_url):
    since = f"{time.time() - 1:.3f}"
    a, b = _client(keyed_app_url, LEDGER_A), _client(keyed_app_url, LEDGER_B)
    told = {("ledger-a", CHAT_MODEL): _new(), ("ledger-a", EMBED_MODEL): _new(), ("ledger-b", CHAT_MODEL): _new()}
    question = [{"role": "user", "content": "Name three rivers of Europe, briefly."}]
    for _ in range(3):  # the same prompt again: the engine may serve its prefix from cache
        reply = a.chat.completions.create(model=CHAT_MODEL, max_tokens=6, messages=question)
        _told(reply.usage, told[("ledger-a", CHAT_MODEL)])
    stream = a.chat.completions.create(model=CHAT_MODEL, max_tokens=6, messages=question, stream=True,
                                       stream_options={"include_usage": True})
    last = [chunk for chunk in stream][-1]
    _told(last.usage, told[("ledger-a", CHAT_MODEL)])
    embedded = a.embeddings.create(model=EMBED_MODEL, input=["a short text", "another short text"])
    _told(embedded.usage, told[("ledger-a", EMBED_MODEL)])
    for tier in ("flex", "default"):
        reply = b.chat.completions.create(model=CHAT_MODEL, max_tokens=4, messages=question,
                                          extra_body={"service_tier": tier})
        _told(reply.usage, told[("ledger-b", CHAT_MODEL)])
    with pytest.raises(openai.BadRequestError):  # refused at the door: it never settles, so no record
        a.chat.completions.create(model=CHAT_MODEL, max_tokens="many",  # type: ignore[arg-type]
                                  messages=question)

    expected = sum(t["requests"] for t in told.values())
    rows = _rows_once_settled(keyed_app_url, expected, since=since, group_by="key,model")
    rows = [r for r in rows if r["key"] in ("ledger-a", "ledger-b")]
    assert {(r["key"], r["model"]) for r in rows} == set(told), rows
    for row in rows:
        want = told[(row["key"], row["model"])]
        assert {k: row[k] for k in want} == want, (row, want)
    # The cost, class by class: the chat model's pricing times the class's price multiplier (batch's is
    # BATCH_PRICE_MULTIPLIER, the others' 1).
    by_class = _usage(keyed_app_url, since=since, group_by="key,model,priority_class").json()["data"]
    for row in (r for r in by_class if r["key"] in ("ledger-a", "ledger-b")):
        if row["model"] == CHAT_MODEL:
            uncached = row["prompt_tokens"] - row["cached_tokens"]
            cost = (uncached * PRICING["input_per_million"] + row["cached_tokens"] * PRICING["cached_input_per_million"]
                    + row["completion_tokens"] * PRICING["output_per_million"]) / 1e6
            multiplier = BATCH_PRICE_MULTIPLIER if row["priority_class"] == "batch" else 1.0
            assert row["cost"] == pytest.approx(cost * multiplier, rel=1e-9), row
        else:
            assert row["cost"] is None, "the embedding model has no pricing"

    by_class = _usage(keyed_app_url, since=since, key="ledger-b", group_by="priority_class,endpoint").json()["data"]
    assert {(r["priority_class"], r["endpoint"], r["requests"]) for r in by_class} == \
        {("batch", "chat", 1), ("standard", "chat", 1)}, by_class


def test_usage_queries_are_checked_and_for_admins_only(keyed_app_url):
    for params, code in (({"group_by": "key,colour"}, "invalid_group_by"), ({"since": "yesterday"}, "invalid_time"),
                         ({"since": "nan"}, "invalid_time"), ({"since": "200", "until": "100"}, "invalid_window")):
        resp = _usage(keyed_app_url, **params)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == code, (params, resp.text)
    client = httpx.get(f"{keyed_app_url}/admin/usage", headers={"Authorization": f"Bearer {LEDGER_A}"},
                       timeout=TIMEOUT_S)
    assert client.status_code == 403, "a client key does not read the ledger"
    everything = _usage(keyed_app_url, group_by="", since="2026-01-01T00:00:00Z")
    assert everything.status_code == 200 and len(everything.json()["data"]) <= 1


def test_openais_usage_api_answers_a_key_with_its_own_buckets_only_and_an_admin_with_every_keys(keyed_app_url):
    """GET /v1/organization/usage/completions (issue 52, item 7) after the requests above (it runs after them:
    pytest keeps a module's order): a client key reads its own usage, equal to what the ledger holds of it;
    an admin key reads every key's."""
    start = int(time.time()) - 3600
    mine = _client(keyed_app_url, LEDGER_A)
    mine.chat.completions.create(model=CHAT_MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi."}])

    def usage_api(key: str, **params: Any) -> dict[str, Any]:
        resp = httpx.get(f"{keyed_app_url}/v1/organization/usage/completions", headers={"Authorization": f"Bearer {key}"},
                         params={"start_time": start, "bucket_width": "1h", **params}, timeout=TIMEOUT_S)
        assert resp.status_code == 200, resp.text
        page = resp.json()
        assert page["object"] == "page" and all(b["object"] == "bucket" for b in page["data"]), page
        return page

    def results(page: dict[str, Any]) -> list[dict[str, Any]]:
        return [r for bucket in page["data"] for r in bucket["results"]]

    deadline = time.monotonic() + 30  # the other gateway's records arrive within its flush interval
    while True:
        held = {r["key"]: r for r in _rows_once_settled(keyed_app_url, 1, since=str(start), group_by="key")}
        own = results(usage_api(LEDGER_A, group_by=["api_key_id", "model"]))
        again = {r["key"]: r for r in _rows_once_settled(keyed_app_url, 1, since=str(start), group_by="key")}
        if held == again or time.monotonic() > deadline:  # nothing arrived while the API was asked
            break
    assert {r["api_key_id"] for r in own} == {key_id(LEDGER_A)}, own
    assert {r["model"] for r in own} <= {CHAT_MODEL, EMBED_MODEL}, own
    assert sum(r["input_tokens"] for r in own) == held["ledger-a"]["prompt_tokens"], (own, held["ledger-a"])
    assert sum(r["output_tokens"] for r in own) == held["ledger-a"]["completion_tokens"]
    assert sum(r["num_model_requests"] for r in own) >= 1
    everyone = {r["api_key_id"] for r in results(usage_api(ADMIN, group_by="api_key_id"))}
    assert {key_id(LEDGER_A), key_id(LEDGER_B)} <= everyone, everyone
    refused = httpx.get(f"{keyed_app_url}/v1/organization/usage/completions", timeout=TIMEOUT_S,
                        params={"bucket_width": "1h"}, headers={"Authorization": f"Bearer {LEDGER_A}"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "start_time", refused.text
