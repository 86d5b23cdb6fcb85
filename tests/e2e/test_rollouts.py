"""A blue-green rollout with real engines under steady load: SmolLM2 v1 -> v2 (both real vLLM engines, one
core each) is promoted with no failed request and no cut stream. `-s` prints its timeline. A bad version
rolled back while a real engine serves is tests/e2e/test_observability.py's (with the dashboards that
show it); every way a version can be bad, tests/integration/test_rollouts.py's."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.local_app import local_app
from tests.rollout_client import Load, start_rollout, timeline, wait_done

from .live import CAPITAL_QUESTION, assert_capital

pytestmark = pytest.mark.own_app

APP = "rollouts-e2e"
MODEL = "smol"
SMOL = "builtin:smollm2-135m-instruct"
ARGS = {
    "models": [{
        "name": MODEL,
        "engine": {"max_model_len": 1024, "max_num_seqs": 16, "cpu_kv_cache_gib": 1},
        "versions": [
            {"name": "v1", "source": SMOL, "weight": 100},
            {"name": "v2", "source": SMOL, "engine": {"max_num_seqs": 8}},
        ],
        # Two engines share two cores and the load, and a version's first requests after its start are
        # its slowest (the p95 of five is the slowest of them): on an AVX2-only 2-core machine v2's TTFT
        # p95 was 2.6 s against v1's 0.5 s, and a 1 s slack rolled a good version back. Latency
        # differences under 10 s are noise here; a latency gate that bites is tests/integration/
        # test_rollouts.py's (a fake engine made slow on demand). Errors are judged strictly.
        "rollout": {"steps": [20, 60, 100], "hold_s": 4, "max_hold_s": 120, "ready_timeout_s": 300,
                    "gates": {"min_requests": 5, "max_error_rate_increase": 0.02, "max_ttft_p95_ratio": 4,
                              "max_e2e_p95_ratio": 4, "latency_slack_s": 10.0}},
        "draining": {"timeout_s": 60},
    }],
}


@pytest.fixture(scope="module")
def app() -> Iterator[str]:
    from tests.e2e.live import wait_ready

    with local_app(ARGS, APP, keep_cluster=True) as base:
        wait_ready(base)
        yield base


def _run_rollout(base: str, to: str) -> tuple[dict, Load]:
    load = Load(base, MODEL, clients=3, max_tokens=12)
    load.start()
    try:
        load.answered(3)  # traffic flows before the rollout starts ...
        started = time.monotonic()
        start_rollout(base, MODEL, to)
        status = wait_done(base, MODEL, timeout_s=600)
        print(f"\nrollout to {to} ({time.monotonic() - started:.0f} s):\n{timeline(status)}")
        load.answered(3)  # ... and after it has ended
    finally:
        load.finish()
    by_version: dict[str | None, int] = {}
    for r in load.results:
        by_version[r["version"]] = by_version.get(r["version"], 0) + 1
    print(f"requests: {len(load.results)} by version {by_version}, failed or cut: {len(load.failures())}")
    return status, load


def test_a_real_version_is_promoted_without_losing_a_request(app):
    status, load = _run_rollout(app, "v2")
    assert status["rollout"]["outcome"] == "promoted", timeline(status)
    assert status["live"] == ["v2"]
    assert not load.failures(), load.failures()[:5]
    for seen in load.conversations().values():
        assert seen == sorted(seen, key=lambda v: v == "v2"), f"a conversation went back: {seen}"
    reply = httpx.post(f"{app}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": CAPITAL_QUESTION}],
        "max_tokens": 20, "temperature": 0})
    assert reply.headers["x-shunter-version"] == "v2"
    assert_capital(reply.json()["choices"][0]["message"]["content"], app, model=MODEL, max_tokens=20)
