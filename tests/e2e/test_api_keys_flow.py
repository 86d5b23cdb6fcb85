"""Flow control on the keyed app (tests/e2e/keyed_app.py; issue 38): who goes first when a model is full,
through both gateway replicas, on the real engine (which schedules by priority there).

The app's two narrow classes, `lane` and the less urgent `lane-low`, may each fill two of a gateway's slots
of the chat model, so a burst of them waits in the gateways' flow queues while the engine has room to spare:
the order in which the requests finish is the order in which the queues let them go (two at a time per
gateway). Each check is a count: a queue in arrival order would fail it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from .keyed_app import FLOOD, FULL, LIGHT, TIMEOUT_S
from .live import CHAT_MODEL

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
