"""OpenAI's rate-limit headers on every response to a known caller, exact after settlement: the real
Forwarder and door behind the gateway's header middleware, in front of the stand-in replica of
tests/unit/test_forward.py (a whole reply that used 3 prompt + 1 completion tokens), on a fake clock."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from shunter.config import parse_config
from shunter.deployments.gateway.access import AccessControl
from shunter.deployments.gateway.forward import Forwarder
from shunter.deployments.gateway.lora import LiveAdapters
from shunter.deployments.gateway.rate_headers import RateLimitHeaders
from shunter.deployments.gateway.request_body import BodyReader
from shunter.deployments.gateway.serving_state import ServingState
from shunter.endpoints import CHAT

from .fake_clock import Clock
from .test_forward import Replica, Traffic

pytestmark = pytest.mark.unit

KEYS = {"Q": "sk-quota-0123456789abcdef", "FREE": "sk-free-0123456789abcdef"}
CONFIG = parse_config({
    "models": [{"name": "m", "source": "builtin:smollm2-135m-instruct"}],
    "auth": {"keys": [{"name": "q", "key_env": "Q", "requests_per_minute": 60, "tokens_per_minute": 600},
                      {"name": "free", "key_env": "FREE"}]}})


def _gateway(clock: Clock) -> Starlette:
    replica, traffic = Replica(), Traffic()
    state = ServingState(CONFIG, {"m": {"default": replica}}, traffic)  # type: ignore[arg-type]
    access = AccessControl(CONFIG, environ=KEYS, clock=clock)
    forwarder = Forwarder(CONFIG, access, BodyReader(CONFIG.gateway), state, traffic, None,  # type: ignore[arg-type]
                          LiveAdapters(CONFIG))
    replica.routing = state.routing(CONFIG.models[0], "default")

    async def chat(request: Request) -> Any:
        return await forwarder.forward(request, CHAT)

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    app.add_middleware(RateLimitHeaders)
    return app


def _post(app: Starlette, key: str | None, body: dict[str, Any]) -> list[httpx.Response]:
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            headers = {"authorization": f"Bearer {KEYS[key]}"} if key else {}
            return await client.post("/v1/chat/completions", json=body, headers=headers)

    return asyncio.run(run())


BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 100}


def _numbers(response: httpx.Response) -> tuple[int, int, int, int]:
    h = response.headers
    return (int(h["x-ratelimit-limit-requests"]), int(h["x-ratelimit-remaining-requests"]),
            int(h["x-ratelimit-limit-tokens"]), int(h["x-ratelimit-remaining-tokens"]))


def test_a_whole_replys_headers_count_its_settled_usage_not_its_reservation():
    clock = Clock()
    app = _gateway(clock)
    first = _post(app, "Q", BODY)
    assert first.status_code == 200, first.text
    # It reserved its prompt estimate plus 100 completion tokens, and used 3 + 1: the headers say 4.
    assert _numbers(first) == (60, 59, 600, 596)
    second = _post(app, "Q", BODY)
    assert _numbers(second) == (60, 58, 600, 592), "they decrease with each request"
    assert second.headers["x-ratelimit-reset-requests"] == "2s" and second.headers["x-ratelimit-reset-tokens"] == "800ms"
    clock.now += 2
    third = _post(app, "Q", BODY)
    assert _numbers(third) == (60, 59, 600, 596), "and reset as the budgets refill"


@pytest.mark.parametrize(("body", "status", "code"), [
    ({**BODY, "model": "nope"}, 404, "model_not_found"),
    ({**BODY, "max_tokens": "many"}, 400, None),
    ({**BODY, "n": 1000}, 400, "n_too_large"),
    ({**BODY, "max_tokens": 1_000}, 429, "request_exceeds_quota"),
])
def test_a_refused_request_of_a_known_caller_carries_its_headers_and_is_charged_nothing(body, status, code):
    clock = Clock()
    app = _gateway(clock)
    refused = _post(app, "Q", body)
    assert refused.status_code == status, refused.text
    if code is not None:
        assert json.loads(refused.text)["error"]["code"] == code
    assert _numbers(refused) == (60, 60, 600, 600)


def test_the_quotas_own_refusal_says_which_budget_ran_out_and_when_it_refills():
    clock = Clock()
    app = _gateway(clock)
    for _ in range(5):
        assert _post(app, "Q", {**BODY, "max_tokens": 110}).status_code == 200
    refused = _post(app, "Q", {**BODY, "max_tokens": 590})
    assert refused.status_code == 429 and json.loads(refused.text)["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert int(refused.headers["x-ratelimit-remaining-tokens"]) < 590


def test_no_headers_without_a_quota_or_without_a_known_caller():
    clock = Clock()
    app = _gateway(clock)
    free = _post(app, "FREE", BODY)
    assert free.status_code == 200 and not any(h.startswith("x-ratelimit-") for h in free.headers)
    stranger = _post(app, None, BODY)
    assert stranger.status_code == 401 and not any(h.startswith("x-ratelimit-") for h in stranger.headers)
