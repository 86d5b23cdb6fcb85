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

import anthropic
import httpx
import openai
import pytest

from .keyed_app import (
    APP,
    CHAT_QUEUE_PER_GATEWAY,
    FLOOD,
    FULL,
    GATEWAYS,
    JOBS,
    LIGHT,
    METERED,
    METERED_REQUESTS_PER_MINUTE,
    TIMEOUT_S,
    URGENT,
)
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

    # A connection for every request: one waiting in the client's pool would arrive after its wave.
    limits = httpx.Limits(max_connections=max(200, sum(count for *_, count in waves)), max_keepalive_connections=0)
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


def test_a_same_class_flood_is_refused_at_the_door_while_a_light_tenant_of_its_class_is_served(keyed_app_url):
    """Issue 52 item 1: the flood fills its class's admission bound (each gateway's share of the model's slots
    plus its queue bound) and is refused past it; the light tenant of the same class, arriving after, is
    within its part of that bound and is admitted, and served first by its place in the fair queue. With
    one count per class, every light request would be a 429."""
    flood = 2 * GATEWAYS * CHAT_QUEUE_PER_GATEWAY + 40  # past both gateways' bounds (capacity + queue each)
    finished = asyncio.run(_burst(keyed_app_url, [("flood", FLOOD, "lane", flood), ("light", LIGHT, "lane", 6)]))
    statuses = {name: sorted(s for n, s, _ in finished if n == name) for name in ("flood", "light")}
    assert statuses["light"] == [200] * 6, statuses["light"]
    assert set(statuses["flood"]) == {200, 429} and len(statuses["flood"]) == flood, statuses["flood"]
    order = [name for name, status, _ in finished if status == 200]
    assert _after_last(order, "light").count("flood") >= 8, "the light tenant's requests go before the flood's"


async def _overtaken(app: str, probe_key: str) -> tuple[int, str]:
    """Standard chats (two sequences each) fill the chat engine's 16 running sequences and its waiting queue;
    a Messages request by `probe_key`, sent a second later, is served beside them. Returns how many of
    the chats finished after it. None of them waits in the gateways: 48 requests are within both gateways'
    turns (32 each) and admission bounds (64 engine requests each), so their order is the engine's."""
    finished: list[str] = []
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits) as client:
        async def chat(i: int) -> None:
            resp = await client.post(f"{app}/v1/chat/completions", json={**_body(i), "n": 2},
                                     headers={"Authorization": f"Bearer {FULL}"})
            assert resp.status_code == 200, resp.text
            finished.append("chat")

        flood = [asyncio.ensure_future(chat(i)) for i in range(48)]
        await asyncio.sleep(1.0)
        claude = anthropic.AsyncAnthropic(base_url=app, api_key=probe_key, timeout=TIMEOUT_S, max_retries=0)
        reply = await claude.messages.with_raw_response.create(
            model=CHAT_MODEL, max_tokens=8, messages=[{"role": "user", "content": "Name a colour."}])
        finished.append("probe")
        await asyncio.gather(*flood)
    return finished[finished.index("probe") + 1:].count("chat"), reply.headers["x-shunter-priority"]


def test_an_interactive_messages_request_overtakes_standard_work_queued_in_the_engine(keyed_app_url):
    """Issue 52 item 5, on the real engine (`scheduling_policy: priority`): the gateway gives a Messages
    request its class's priority, and the replica hands it to the chat request vLLM makes of it (the
    Anthropic request has no such field). A standard Messages request sent the same way is the control:
    it waits behind the chats queued before it; an interactive one goes before them."""
    control, control_class = asyncio.run(_overtaken(keyed_app_url, FULL))
    urgent, urgent_class = asyncio.run(_overtaken(keyed_app_url, URGENT))
    assert (control_class, urgent_class) == ("standard", "interactive")
    assert urgent >= 16 and urgent >= control + 8, (urgent, control)


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
