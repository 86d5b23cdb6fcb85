"""Flow control on the keyed app (tests/e2e/keyed_app.py; issue 38): who goes first when a model is full,
through both gateway replicas, on the real engine (which schedules by priority there).

The app's two narrow classes, `lane` and the less urgent `lane-low`, may each fill two of a gateway's slots
of the chat model, so a burst of them waits in the gateways' flow queues while the engine has room to spare:
the order in which the requests finish is the order in which the queues let them go (two at a time per
gateway). Each check is a count: a queue in arrival order would fail it.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import Any

import httpx
import openai
import pytest

from .keyed_app import APP, FLOOD, FULL, JOBS, LIGHT, METERED, METERED_REQUESTS_PER_MINUTE, TIMEOUT_S
from .live import CHAT_MODEL, gateways_that_served

pytestmark = pytest.mark.own_app


def _body(i: int) -> dict[str, Any]:
    return {"model": CHAT_MODEL, "max_tokens": 8, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Count to ten, attempt {i}."}]}


async def _burst(app: str, waves: list[tuple[str, str, str, int]]) -> list[tuple[str, int, float]]:
    """Each wave (name, key, class, count) is sent at once, 0.5 s after the previous one; returns (name,
    status, finished-at) for every request, in the order they finished."""
    finished: list[tuple[str, int, float]] = []

    async def one(client: httpx.AsyncClient, name: str, key: str, cls: str, i: int) -> None:
        resp = await client.post(f"{app}/v1/chat/completions", json=_body(i), headers={
            "Authorization": f"Bearer {key}", "x-shunter-priority": cls})
        assert resp.headers.get("x-shunter-priority") == cls, resp.text
        finished.append((name, resp.status_code, time.monotonic()))

    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits) as client:
        tasks = []
        for n, (name, key, cls, count) in enumerate(waves):
            if n:
                await asyncio.sleep(0.5)
            tasks += [asyncio.ensure_future(one(client, name, key, cls, n * 1000 + i)) for i in range(count)]
        await asyncio.gather(*tasks)
    return finished


def _finish_order(app: str, waves: list[tuple[str, str, str, int]]) -> list[str]:
    finished = asyncio.run(_burst(app, waves))
    assert {status for _, status, _ in finished} == {200}, finished
    return [name for name, _, _ in finished]


def _after_last(order: list[str], name: str) -> list[str]:
    """What finished after the last of `name`'s requests."""
    return order[max(i for i, n in enumerate(order) if n == name) + 1:]


def test_with_a_held_queue_a_more_urgent_class_starts_before_earlier_less_urgent_requests(keyed_app_url):
    order = _finish_order(keyed_app_url, [("low", FULL, "lane-low", 24), ("high", FULL, "lane", 6)])
    # Four at a time across the two gateways: the 24 low requests take six rounds; the 6 high ones, sent
    # half a second later, go in the next round or two, ahead of every low request still waiting.
    assert _after_last(order, "high").count("low") >= 8, order


def test_a_flooding_tenant_gets_no_more_than_its_share_while_another_of_its_class_waits(keyed_app_url):
    order = _finish_order(keyed_app_url, [("flood", FLOOD, "lane", 24), ("light", LIGHT, "lane", 6)])
    # Equal weights: once the light tenant's 6 arrive, the queues alternate between the two tenants, so
    # its requests are done while most of the flood, sent earlier, still waits. In arrival order the
    # light tenant's would finish last.
    assert _after_last(order, "light").count("flood") >= 8, order


def test_an_unknown_or_forbidden_class_is_refused_and_engine_priority_cannot_be_forged(keyed_app_url):
    headers = {"Authorization": f"Bearer {LIGHT}"}
    url = f"{keyed_app_url}/v1/chat/completions"
    forged = httpx.post(url, json={**_body(0), "priority": -100}, headers=headers, timeout=TIMEOUT_S)
    assert forged.status_code == 400 and forged.json()["error"]["code"] == "priority_not_allowed", forged.text
    served = httpx.post(url, json={**_body(0), "service_tier": "priority"}, headers=headers, timeout=TIMEOUT_S)
    assert served.status_code == 403 and served.json()["error"]["code"] == "priority_class_not_allowed", \
        "a standard key may not ask for interactive"
    flex = httpx.post(url, json={**_body(0), "service_tier": "flex"}, headers=headers, timeout=TIMEOUT_S)
    assert flex.status_code == 200 and flex.headers["x-shunter-priority"] == "batch", flex.text


def test_auto_is_the_keys_own_class_and_every_reply_and_chunk_says_the_tier_served(keyed_app_url):
    """OpenAI's tiers through the official SDKs (issue 52): `auto` is the key's default class (a batch key's
    `auto` was a 403 while it meant `standard`), and `service_tier` on a reply, on each streamed chunk and on
    a Responses object is the tier of the class served: `flex` for batch, `default` for standard. The
    Messages API takes Anthropic's `auto` and `standard_only`, and refuses OpenAI's values."""
    import anthropic

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{keyed_app_url}/v1", api_key=key, timeout=TIMEOUT_S, max_retries=0)

    messages = [{"role": "user", "content": "Name a colour."}]
    jobs = client(JOBS).chat.completions.with_raw_response.create(
        model=CHAT_MODEL, messages=messages, max_tokens=4, service_tier="auto")
    assert jobs.headers["x-shunter-priority"] == "batch" and jobs.parse().service_tier == "flex"
    chunks = list(client(LIGHT).chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=4,
                                                         stream=True, stream_options={"include_usage": True}))
    assert len(chunks) > 2 and {c.service_tier for c in chunks} == {"default"}, [c.service_tier for c in chunks]
    assert chunks[-1].usage is not None, "the usage chunk says it too"
    # The SDK's legacy completions take no service_tier argument; the API reads the field all the same.
    lowered = client(LIGHT).completions.create(model=CHAT_MODEL, prompt="Once", max_tokens=4,
                                               extra_body={"service_tier": "flex"})
    assert getattr(lowered, "service_tier", None) == "flex", lowered
    reply = client(JOBS).responses.create(model=CHAT_MODEL, input="Name a colour.", max_output_tokens=8,
                                          service_tier="auto")
    assert reply.service_tier == "flex", reply.service_tier
    events = list(client(LIGHT).responses.create(model=CHAT_MODEL, input="Name a colour.", max_output_tokens=8,
                                                 stream=True))
    # Eight tokens (the app's limit) end the response incomplete; each event with the response object says it.
    with_response = [e for e in events if getattr(e, "response", None) is not None]
    assert with_response[-1] is events[-1] and events[-1].type in ("response.completed", "response.incomplete")
    assert {e.response.service_tier for e in with_response} == {"default"}, [e.type for e in with_response]

    claude = anthropic.Anthropic(base_url=keyed_app_url, api_key=FULL, timeout=TIMEOUT_S, max_retries=0)
    answer = claude.messages.with_raw_response.create(model=CHAT_MODEL, max_tokens=4, messages=messages,
                                                      service_tier="standard_only")
    assert answer.headers["x-shunter-priority"] == "standard" and answer.parse().content
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=CHAT_MODEL, max_tokens=4, messages=messages,
                               extra_body={"service_tier": "flex"})
    assert "standard_only" in str(refused.value)


def _seconds(reset: str) -> float:
    """OpenAI's reset duration (`800ms`, `1.5s`, `1m0s`) in seconds."""
    parts = re.fullmatch(r"(?:(\d+)m)?(?:([\d.]+)s)?|(\d+)ms", reset)
    assert parts is not None and reset, reset
    if parts.group(3) is not None:
        return int(parts.group(3)) / 1000
    return int(parts.group(1) or 0) * 60 + float(parts.group(2) or 0)


def test_every_answer_to_a_metered_key_carries_rate_limit_headers_that_decrease_and_reset(keyed_app_url):
    """Read with the official SDK, as a client would: each gateway holds half the key's requests per minute
    and reports its remaining half scaled to the whole key, so each request a gateway serves takes 2 off,
    and its bucket refills meanwhile at 1 a second (scaled: 60 a minute over the key): between two of its
    answers the figure stays below the earlier one plus the seconds that passed (2 taken, and rounding down
    loses less than 2)."""
    client = openai.OpenAI(base_url=f"{keyed_app_url}/v1", api_key=METERED, max_retries=0, timeout=TIMEOUT_S)
    limit = METERED_REQUESTS_PER_MINUTE
    seen: dict[str, tuple[int, float]] = {}
    sent, answered = {}, {}  # when each request left and its answer came (bounds what the gateway saw)
    for i in range(6):
        rid = f"metered-{uuid.uuid4().hex}"
        sent[rid] = time.monotonic()
        raw = client.chat.completions.with_raw_response.create(
            model=CHAT_MODEL, max_tokens=2, messages=[{"role": "user", "content": f"Say hi {i}."}],
            extra_headers={"X-Request-ID": rid})
        answered[rid] = time.monotonic()
        assert raw.parse().usage.completion_tokens > 0
        assert raw.headers["x-ratelimit-limit-requests"] == str(limit)
        assert raw.headers["x-ratelimit-limit-tokens"] == "60000"
        assert 0 < int(raw.headers["x-ratelimit-remaining-tokens"]) < 60_000
        seen[rid] = (int(raw.headers["x-ratelimit-remaining-requests"]), _seconds(raw.headers["x-ratelimit-reset-requests"]))
    gateway_of = gateways_that_served(APP, list(seen))
    assert set(gateway_of) == set(seen), gateway_of
    for gateway in set(gateway_of.values()):
        served = [rid for rid in seen if gateway_of[rid] == gateway]  # in the order sent
        remaining = [seen[rid][0] for rid in served]
        for earlier, later in zip(served, served[1:], strict=False):
            # 2 taken, at most `refilled` (scaled) back, and the figure rounded down by less than 2.
            refilled = answered[later] - sent[earlier]
            assert seen[later][0] < seen[earlier][0] + refilled, (gateway, remaining, refilled)
        assert limit - 2 * len(remaining) <= remaining[-1] < limit, (gateway, remaining)
    # Every answer, not only replies: a refused body and the model list carry them too.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=CHAT_MODEL, max_tokens="lots",  # type: ignore[arg-type]
                                       messages=[{"role": "user", "content": "hi"}])
    assert refused.value.response.headers["x-ratelimit-limit-requests"] == str(limit)
    listed = client.models.with_raw_response.list()
    assert int(listed.headers["x-ratelimit-remaining-requests"]) < limit
    # Once the longest reset has passed, both gateways' budgets are full again.
    time.sleep(max(reset for _, reset in seen.values()) + 1)
    after = client.chat.completions.with_raw_response.create(
        model=CHAT_MODEL, max_tokens=2, messages=[{"role": "user", "content": "Say hi again."}])
    assert int(after.headers["x-ratelimit-remaining-requests"]) == limit - 2, "reset: only this request taken"
