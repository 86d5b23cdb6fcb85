"""Complexity tiers with real engines: configs/tiers.yaml's two SmolLM2 tiers and MiniLM for the monitor.

Simple and complex prompts land on the expected tiers through `model: auto`, with the official client,
streaming included; the decision is in the response headers. The monitor re-asks every small-tier
request of both tiers here (sample_ratio 1): greedy answers of the same weights agree and nothing
moves, and a client sampling wildly (temperature 2, one token) cannot make them disagree, because the
monitor asks the question itself, greedily. (A real promotion needs two tiers that answer differently:
both tiers here are SmolLM2; the promotion itself is unit-tested in tests/unit/test_tiers.py.)

The monitor never adds to an overload: while the top tier is at its admission bound, samples are
skipped (and taken again once it has room). The two other routing policies serve here too: the large
tier through Ray's own `PrefixCacheAffinityRouter` (policy `custom`), MiniLM through `power_of_two`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.integration.local_app import kept_metrics_url, local_app

from .live import CAPITAL_QUESTION, ROOT, assert_capital, metric_total, scrape_until, wait_ready

pytestmark = pytest.mark.own_app

APP = "tiers-e2e"
SIMPLE = CAPITAL_QUESTION
CODE = "Write a Python function that reverses a string."
MATH = "Solve for x: 3x + 7 = 22"
RAY_PREFIX_ROUTER = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
# The top tier's admission bound (replicas x max_ongoing_requests + max_queued_requests): small enough
# to fill with a few streams, above the monitor comparisons a burst of sampled requests runs at once.
LARGE_ONGOING, LARGE_QUEUED = 4, 4


def _args() -> dict[str, Any]:
    (app,) = yaml.safe_load((ROOT / "configs" / "tiers.yaml").read_text())["applications"]
    args = app["args"]
    args["tiers"]["monitor"].update(sample_ratio=1.0, min_samples=3, agreement_threshold=0.9)
    models = {m["name"]: m for m in args["models"]}
    models["smollm2-large"].update(max_ongoing_requests=LARGE_ONGOING,
                                   admission={"max_queued_requests": LARGE_QUEUED},
                                   routing={"policy": "custom", "router_class": RAY_PREFIX_ROUTER})
    models["all-minilm-l6-v2"]["routing"] = {"policy": "power_of_two"}
    return args


@pytest.fixture(scope="module")
def app() -> Iterator[str]:
    with local_app(_args(), APP, keep_cluster=True) as base:
        wait_ready(base)
        yield base


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(base: str, prompt: str, **extra: Any) -> tuple[str, str, str]:
    """(tier, reason header, answer) of a chat to `auto`."""
    raw = client(base).chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": prompt}], max_tokens=extra.pop("max_tokens", 16),
        **{"temperature": 0, **extra})
    reply = raw.parse()
    return raw.headers["x-shunter-tier"], raw.headers["x-shunter-tier-reason"], reply.choices[0].message.content


def tiers(base: str) -> dict[str, Any]:
    resp = httpx.get(f"{base}/admin/tiers", timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def wait_for(base: str, check: Any, timeout_s: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    status = tiers(base)
    while not check(status) and time.monotonic() < deadline:
        time.sleep(1)
        status = tiers(base)
    return status


def test_auto_is_listed_with_its_tiers(app):
    models = {m.id: m for m in client(app).models.list()}
    assert "auto" in models and models["auto"].model_extra["tiers"] == ["small", "large"]


def test_simple_and_complex_prompts_land_on_their_tiers(app):
    tier, reason, answer = ask(app, SIMPLE)
    assert tier == "small" and "class=simple" in reason and "model=smollm2-small" in reason
    assert_capital(answer, app, model="smollm2-small", max_tokens=16)
    tier, reason, _ = ask(app, CODE)
    assert tier == "large" and "class=code" in reason and "reason=complexity" in reason
    hinted = client(app).chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": SIMPLE}], max_tokens=4,
        extra_headers={"x-shunter-tier": "large"})
    assert hinted.headers["x-shunter-tier"] == "large" and "reason=hint" in hinted.headers["x-shunter-tier-reason"]


def test_auto_streams_with_the_official_client_and_serves_completions(app):
    raw = client(app).chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": SIMPLE}], max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True})
    assert raw.headers["x-shunter-tier"] == "small"
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens > 0
    assert_capital(text, app, model="smollm2-small", max_tokens=16)
    completion = client(app).completions.with_raw_response.create(model="auto", prompt="def add(a, b):", max_tokens=8)
    assert completion.headers["x-shunter-tier"] == "large" and completion.parse().choices[0].text


def test_the_agent_apis_route_by_tier_too(app):
    """Responses and Messages requests to `auto` are classified on their input like a chat."""
    simple = client(app).responses.with_raw_response.create(model="auto", input=SIMPLE, max_output_tokens=8)
    assert simple.headers["x-shunter-tier"] == "small" and simple.parse().model == "smollm2-small"
    code = httpx.post(f"{app}/v1/messages", timeout=120, json={
        "model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": CODE}]})
    assert code.status_code == 200 and code.headers["x-shunter-tier"] == "large", code.text
    assert code.json()["model"] == "smollm2-large"


def test_agreeing_answers_move_nothing(app):
    for _ in range(3):
        ask(app, SIMPLE)
    status = wait_for(app, lambda s: s["monitor"]["windows"].get("simple@0", {}).get("samples", 0) >= 3)
    window = status["monitor"]["windows"]["simple@0"]
    assert window["samples"] >= 3 and window["mean_agreement"] >= 0.9, status
    assert status["promotions"] == {}


def test_a_client_sampling_wildly_cannot_promote_a_class(app):
    tier, _, _ = ask(app, MATH)
    assert tier == "small"
    for seed in range(4):  # the old monitor compared these answers with a greedy reference, and promoted
        ask(app, MATH, temperature=2.0, seed=seed, max_tokens=1)
    status = wait_for(app, lambda s: s["monitor"]["windows"].get("math@0", {}).get("samples", 0) >= 5)
    window = status["monitor"]["windows"]["math@0"]
    assert window["mean_agreement"] >= 0.9 and status["promotions"] == {}, status
    tier, reason, _ = ask(app, MATH)
    assert tier == "small" and "reason=promoted" not in reason


def test_tier_metrics_count_requests_cost_and_promotions(app):
    url = kept_metrics_url()
    text = scrape_until(url, [
        ("ray_shunter_tier_requests_total", {"tier": "small"}),
        ("ray_shunter_tier_tokens_total", {"tier": "large", "kind": "completion"}),
        ("ray_shunter_tier_agreement_count", {"class": "simple"}),
    ])
    assert 'endpoint="tier_monitor"' in text  # the monitor's own requests are told apart
    text = scrape_until(url, [("ray_shunter_tier_cost_total", {"basis": "top_tier"}),
                              ("ray_shunter_tier_cost_total", {"basis": "routed"})], at_least=1e-9)
    routed = metric_total(text, "ray_shunter_tier_cost_total", basis="routed")
    assert 0 < routed < metric_total(text, "ray_shunter_tier_cost_total", basis="top_tier")  # small tier was cheaper
    # Every policy placed requests: the default on the small tier, Ray's router on the large one, and
    # power of two choices for the embeddings the monitor compares.
    scrape_until(url, [("ray_shunter_routing_decisions_total", {"model": "smollm2-small", "policy": "prefix_aware"}),
                       ("ray_shunter_routing_decisions_total", {"model": "smollm2-large", "policy": "custom"}),
                       ("ray_shunter_routing_decisions_total", {"model": "all-minilm-l6-v2",
                                                                "policy": "power_of_two"})])


def _samples(base: str) -> int:
    return tiers(base)["monitor"]["windows"].get("simple@0", {}).get("samples", 0)


def test_the_monitor_skips_samples_while_the_top_tier_is_full(app):
    hang_up = threading.Event()
    body = {"model": "smollm2-large", "messages": [{"role": "user", "content": "Count to one thousand."}],
            "max_tokens": 1500, "ignore_eos": True, "stream": True}  # long: it stops at max_tokens only

    def hold(head: Future) -> None:
        """One stream: `head` gets (status, error code) as soon as the gateway answered; an admitted
        stream then stays open, unread, until we hang up."""
        try:
            with httpx.stream("POST", f"{app}/v1/chat/completions", json=body, timeout=120) as resp:
                if resp.status_code == 200:
                    head.set_result((200, None))
                    hang_up.wait(120)
                    return
                resp.read()
                head.set_result((resp.status_code, resp.json()["error"]["code"]))
        except BaseException as exc:
            if not head.done():
                head.set_exception(exc)
            raise

    deadline = time.monotonic() + 60
    while True:  # the comparisons earlier tests' requests started have all finished: the top tier is idle
        listed = httpx.get(f"{app}/admin/models/smollm2-large/replicas", timeout=30).json()["replicas"]
        if all(r["in_flight_here"] == 0 for r in listed):
            break
        assert time.monotonic() < deadline, f"the top tier never went idle: {listed}"
        time.sleep(0.5)
    before = _samples(app)
    bound = LARGE_ONGOING + LARGE_QUEUED
    extra = 4
    with ThreadPoolExecutor(bound + extra) as pool:
        heads: list[Future] = [Future() for _ in range(bound + extra)]
        streams = [pool.submit(hold, head) for head in heads]
        try:
            # The bound's running streams answer with their first chunk and the ones past the bound with
            # a 429; queued streams answer nothing until a slot frees. Counted by answer, not by a
            # time: with the held streams decoding on both cores, a refusal's way back may take seconds.
            deadline = time.monotonic() + 60
            while sum(h.done() for h in heads) < LARGE_ONGOING + extra and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1)  # nothing more answers: the queued streams wait
            answers = [h.result() for h in heads if h.done()]
            refused = [a for a in answers if a != (200, None)]
            held = [s for s, h in zip(streams, heads, strict=True) if not h.done() or h.result() == (200, None)]
            assert refused == [(429, "queue_full")] * extra, (answers, len(heads))
            assert len(held) == bound, f"{len(held)} streams admitted, the bound is {bound}"
            for _ in range(2):
                tier, _, answer = ask(app, SIMPLE)
                assert tier == "small" and answer  # the client is served by its tier all the same
            time.sleep(5)  # a comparison takes about a second here (see the positive control below)
            assert _samples(app) == before, "the monitor asked the full top tier"
        finally:
            hang_up.set()
        for stream in held:
            stream.result(timeout=120)  # each held stream closed without an error
    ask(app, SIMPLE)  # room again: this one is compared
    assert wait_for(app, lambda s: s["monitor"]["windows"].get("simple@0", {}).get("samples", 0) > before,
                    timeout_s=60)["monitor"]["windows"]["simple@0"]["samples"] > before
