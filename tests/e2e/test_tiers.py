"""Complexity tiers with real engines: configs/tiers.yaml's two SmolLM2 tiers and MiniLM for the monitor.

Simple and complex prompts land on the expected tiers through `model: auto`, with the official client,
streaming included; the decision is in the response headers. The monitor re-asks every small-tier
request of both tiers here (sample_ratio 1): greedy answers of the same weights agree and nothing
moves, and a client sampling wildly (temperature 2, one token) cannot make them disagree, because the
monitor asks the question itself, greedily. (A real promotion needs two tiers that answer differently:
both tiers here are SmolLM2; the promotion itself is unit-tested in tests/unit/test_tiers.py.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.integration.local_app import local_app

from .live import CAPITAL_QUESTION, ROOT, metric_total, scrape_until, wait_ready

pytestmark = pytest.mark.own_cluster

APP = "tiers-e2e"
SIMPLE = CAPITAL_QUESTION
CODE = "Write a Python function that reverses a string."
MATH = "Solve for x: 3x + 7 = 22"


def _args() -> dict[str, Any]:
    (app,) = yaml.safe_load((ROOT / "configs" / "tiers.yaml").read_text())["applications"]
    args = app["args"]
    args["tiers"]["monitor"].update(sample_ratio=1.0, min_samples=3, agreement_threshold=0.9)
    return args


@pytest.fixture(scope="module")
def app(exclusive_machine) -> Iterator[str]:
    with local_app(_args(), APP) as base:
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
    assert "Paris" in answer
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
    assert "Paris" in text and chunks[-1].usage.completion_tokens > 0
    completion = client(app).completions.with_raw_response.create(model="auto", prompt="def add(a, b):", max_tokens=8)
    assert completion.headers["x-shunter-tier"] == "large" and completion.parse().choices[0].text


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
    import ray

    port = ray._private.worker._global_node.metrics_export_port
    url = f"http://127.0.0.1:{port}/metrics"
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
