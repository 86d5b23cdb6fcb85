"""Per-key quotas: token buckets on a fake clock, reservation and settlement, the 429s and the
rate-limit headers, one key's budget never touching another's."""

from __future__ import annotations

import pytest

from shunter.config import parse_config
from shunter.deployments.gateway.access import AccessControl
from shunter.deployments.gateway.parsed_request import parse
from shunter.deployments.gateway.quotas import KeyQuota, TokenBucket, duration, estimate_prompt_tokens
from shunter.endpoints import ENDPOINTS
from shunter.errors import ApiError

from .fake_clock import Clock

KEYS = {"A": "sk-team-a-0123456789abcdef", "B": "sk-team-b-0123456789abcdef"}


def test_a_bucket_starts_full_refills_at_its_rate_and_never_past_its_capacity():
    clock = Clock()
    bucket = TokenBucket(60, 1.0, clock)
    assert bucket.wait_for(60) == 0
    bucket.take(60)
    assert bucket.wait_for(1) == pytest.approx(1.0)
    clock.now += 30
    assert bucket.remaining() == 30 and bucket.wait_for(40) == pytest.approx(10.0)
    clock.now += 1000
    assert bucket.remaining() == 60 and bucket.until_full_s() == 0


def test_a_charge_past_the_level_is_a_debt_paid_by_waiting():
    clock = Clock()
    bucket = TokenBucket(60, 1.0, clock)
    bucket.take(100)
    assert bucket.remaining() == 0 and bucket.wait_for(1) == pytest.approx(41.0)
    bucket.give_back(500)
    assert bucket.remaining() == 60


def test_requests_per_minute_refuse_the_request_past_the_budget_until_it_refills():
    clock = Clock()
    quota = KeyQuota(requests_per_minute=3, tokens_per_minute=None, clock=clock)
    assert all(quota.admit(0).admitted for _ in range(3))
    refused = quota.admit(0)
    assert (refused.admitted, refused.limit, refused.retry_after_s) == (False, "requests", 20)
    clock.now += 20
    assert quota.admit(0).admitted


def test_tokens_are_reserved_then_settled_at_real_usage():
    clock = Clock()
    quota = KeyQuota(requests_per_minute=None, tokens_per_minute=600, clock=clock)
    first = quota.admit(500)
    assert first.admitted and first.reserved == 500
    refused = quota.admit(200)  # 100 left: the reservation does not fit
    assert (refused.limit, refused.retry_after_s) == ("tokens", 10)
    quota.settle(500, 120)  # it used 120: 380 come back
    assert quota.tokens.remaining() == 480 and quota.admit(200).admitted


def test_usage_past_the_reservation_is_charged_and_makes_the_key_wait():
    clock = Clock()
    quota = KeyQuota(requests_per_minute=None, tokens_per_minute=600, clock=clock)
    quota.settle(quota.admit(10).reserved, 900)  # asked for nothing, used 900: 300 in debt
    refused = quota.admit(1)
    assert not refused.admitted and refused.retry_after_s == 31
    clock.now += 31
    assert quota.admit(1).admitted


def test_a_request_larger_than_the_whole_budget_never_fits_and_says_so_without_retry_after():
    quota = KeyQuota(requests_per_minute=None, tokens_per_minute=100, clock=Clock())
    decision = quota.admit(101)
    assert decision.never_fits and decision.retry_after_s is None
    assert quota.tokens.remaining() == 100  # nothing was taken


def test_a_refused_request_takes_nothing_from_either_bucket():
    clock = Clock()
    quota = KeyQuota(requests_per_minute=10, tokens_per_minute=100, clock=clock)
    quota.admit(100)
    assert not quota.admit(50).admitted
    assert quota.requests.remaining() == 9


def test_gateway_replicas_share_a_key_budget_and_headers_speak_for_the_whole_key():
    clock = Clock()
    quota = KeyQuota(requests_per_minute=60, tokens_per_minute=1000, share=0.5, clock=clock)
    assert quota.requests.capacity == 30 and quota.tokens.capacity == 500
    headers = quota.admit(100).headers
    assert headers["x-ratelimit-limit-requests"] == "60" and headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-requests"] == "58" and headers["x-ratelimit-remaining-tokens"] == "800"
    assert headers["x-ratelimit-reset-requests"] == "2s" and headers["x-ratelimit-reset-tokens"] == "12s"


@pytest.mark.parametrize("seconds, text", [(0.0, "0ms"), (0.25, "250ms"), (1.04, "1.1s"), (59.9, "59.9s"),
                                           (60, "1m0s"), (361, "6m1s")])
def test_reset_durations_read_like_openais(seconds, text):
    assert duration(seconds) == text


@pytest.mark.parametrize("body, tokens", [
    # 40 characters of content, "user", and 4 tokens of per-message overhead
    ({"messages": [{"role": "user", "content": "x" * 40}]}, 15),
    # content parts count like a string: the text, the part's type, the role, the overhead
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 40}]}]}, 16),
    ({"prompt": "abcd" * 5}, 5), ({"prompt": ["abcd", "abcdabcd"]}, 3), ({"prompt": [1, 2, 3]}, 3),
    ({"prompt": [[1, 2, 3], [4, 5]]}, 5), ({"input": ["a" * 9]}, 3), ({"messages": "junk", "prompt": {"x": 1}}, 0),
])
def test_prompt_estimates(body, tokens):
    assert estimate_prompt_tokens(body) == tokens


def test_tool_definitions_and_documents_count_toward_the_prompt():
    bare = {"messages": [{"role": "user", "content": "hi"}]}
    tool = {"type": "function", "function": {"name": "lookup", "description": "x" * 400, "parameters": {}}}
    assert estimate_prompt_tokens({**bare, "tools": [tool]}) >= estimate_prompt_tokens(bare) + 100
    assert estimate_prompt_tokens({**bare, "documents": [{"text": "y" * 400}]}) >= estimate_prompt_tokens(bare) + 100


# ---- through the door: one key's budget is its own ----------------------------------------------------

def door(clock: Clock, replicas: int = 1) -> AccessControl:
    cfg = parse_config({
        "models": [{"name": "chat", "source": "builtin:smollm2-135m-instruct"}],
        "gateway": {"replicas": replicas},
        "auth": {"keys": [{"name": "a", "key_env": "A", "tokens_per_minute": 100, "requests_per_minute": 50},
                          {"name": "b", "key_env": "B"}]}})
    return AccessControl(cfg, environ=KEYS, clock=clock)


def test_a_key_over_its_token_budget_gets_429_while_another_key_is_served():
    clock = Clock()
    access = door(clock)
    a, b = access.client({"authorization": f"Bearer {KEYS['A']}"}), access.client({"authorization": f"Bearer {KEYS['B']}"})
    body = parse(ENDPOINTS["chat"], {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 40})
    first = access.admit(a, "chat", body)  # reserves 7 (prompt estimate) + 40 of 100
    assert first.reserved == 47
    first.settle(200, 30, 40)  # used 70: 30 left, less than the next reservation
    with pytest.raises(ApiError) as caught:
        access.admit(a, "chat", body)
    error = caught.value
    assert (error.status, error.code) == (429, "rate_limit_exceeded")
    assert error.headers["Retry-After"] == "11" and error.headers["x-ratelimit-remaining-tokens"] == "30"
    assert error.body()["error"]["type"] == "rate_limit_error"
    for _ in range(20):
        access.admit(b, "chat", body).settle(200, 30, 40)  # b has no quota
    clock.now += 60
    assert access.admit(a, "chat", body).reserved == 47


def test_a_request_no_budget_can_hold_is_refused_with_its_reason():
    access = door(Clock())
    a = access.client({"authorization": f"Bearer {KEYS['A']}"})
    with pytest.raises(ApiError) as caught:
        access.admit(a, "chat", parse(ENDPOINTS["chat"], {"messages": [], "max_tokens": 500}))
    assert caught.value.code == "request_exceeds_quota" and "Retry-After" not in caught.value.headers


def test_a_failed_request_gives_its_reservation_back():
    clock = Clock()
    access = door(clock)
    a = access.client({"authorization": f"Bearer {KEYS['A']}"})
    ticket = access.admit(a, "chat", parse(ENDPOINTS["chat"], {"messages": [], "max_tokens": 90}))
    ticket.settle(503, 0, 0)
    ticket.settle(503, 0, 0)  # settling twice changes nothing
    assert access._quota(a).tokens.remaining() == 100


# ---- reservations cover what the request may really generate -------------------------------------------

@pytest.mark.parametrize("endpoint, body, reserved", [
    ("chat", {"messages": [], "max_tokens": "10", "n": "3"}, 30),  # strings count as the numbers they become
    ("chat", {"messages": [], "max_tokens": 10.0, "n": 2.0}, 20),
    ("chat", {"messages": [], "max_completion_tokens": 7}, 7),
    ("completion", {"prompt": ["a", "b", "c"], "max_tokens": 5, "n": 2}, 3 + 30),  # every prompt of a batch
    ("completion", {"prompt": "abcd"}, 1 + 16),  # vLLM's default of 16
])
def test_a_reservation_covers_every_choice_and_prompt_at_the_parsed_values(endpoint, body, reserved):
    access = door(Clock())
    a = access.client({"authorization": f"Bearer {KEYS['A']}"})
    assert access.admit(a, "chat", parse(ENDPOINTS[endpoint], body)).reserved == reserved


def test_a_chat_without_max_tokens_reserves_the_default_the_replica_applies_within_the_budget():
    access = door(Clock())  # 100 tokens a minute; the platform's default max_tokens is 4096
    a = access.client({"authorization": f"Bearer {KEYS['A']}"})
    ticket = access.admit(a, "chat", parse(ENDPOINTS["chat"], {"messages": [{"role": "user", "content": "hello"}]}), 2048)
    assert ticket.default_max_tokens == 100 - 7  # what the budget holds beside the prompt
    assert ticket.reserved == 100  # the whole budget: a second such request waits
    b = access.client({"authorization": f"Bearer {KEYS['B']}"})  # no quota: the limit and the context
    assert access.admit(b, "chat", parse(ENDPOINTS["chat"], {"messages": []}), 2048).default_max_tokens == 2048


def test_a_stream_cut_short_is_charged_what_it_produced_and_its_prompt():
    clock = Clock()
    access = door(clock)
    a = access.client({"authorization": f"Bearer {KEYS['A']}"})
    ticket = access.admit(a, "chat", parse(ENDPOINTS["chat"], {"messages": [{"role": "user", "content": "hello"}],
                                                    "max_tokens": 90}))
    ticket.settle(499, 0, 0)  # the client hung up before any usage arrived: its prompt estimate is kept
    assert access._quota(a).tokens.remaining() == 100 - 7
    ticket = access.admit(a, "chat", parse(ENDPOINTS["chat"], {"messages": [], "max_tokens": 50}))
    ticket.settle("stream_error", 3, 40)
    assert access._quota(a).tokens.remaining() == 100 - 7 - 43
