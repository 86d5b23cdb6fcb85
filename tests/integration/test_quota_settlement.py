"""A key's quota is charged what a stream produced when the request timeout or the idle timeout cuts
it. (Cut by the client hanging up: tests/e2e/test_api_keys_hostile.py, on the real engine; cut by a
drain: tests/integration/test_draining.py.)

These cuts are faults (a stall, a stream longer than the platform allows), so the FAKE engine serves here; like vLLM with `continuous_usage_stats`, it reports the running
usage on every chunk, one prompt token per word. What each key was charged is read two ways: exactly,
from the `shunter_key_tokens_total` the settlement records, and from the key's bucket (the
`x-ratelimit-remaining-tokens` of its next request), which must have been given back what the stream
did not use and kept what it did.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from shunter.auth import new_key
from tests.e2e.live import metric_total, scrape_until
from tests.integration.local_app import kept_metrics_url, local_app

APP = "settlement"
MODEL = "paced"
REQUEST_TIMEOUT_S, STREAM_IDLE_TIMEOUT_S = 12.0, 2.0
TOKENS_PER_MINUTE = 300  # 5 a second refill
PROMPT = "pace=0.5 " + "w " * 99  # 100 prompt tokens for the fake engine; its stream: two words a second, 50 s
MAX_TOKENS = 200  # reserved at admission with the prompt's estimate (~56), never reached: the stream is cut first
KEYS = {name: new_key() for name in ("timeout", "idle", "probe")}
# In the environment the kept cluster's processes inherit (see test_draining.py).
os.environ.update({f"SETTLEMENT_KEY_{name.upper()}": key for name, key in KEYS.items()})


@pytest.fixture(scope="module")
def app() -> Iterator[tuple[str, str]]:
    args = {
        "models": [{"name": MODEL, "source": "fake:paced", "accelerator": "cpu"}],
        "gateway": {"queue_timeout_s": 5, "body_timeout_s": 5, "limits": {"request_timeout_s": REQUEST_TIMEOUT_S,
                                                     "stream_idle_timeout_s": STREAM_IDLE_TIMEOUT_S}},
        "auth": {"keys": [{"name": name, "key_env": f"SETTLEMENT_KEY_{name.upper()}",
                           "tokens_per_minute": TOKENS_PER_MINUTE} for name in KEYS]},
    }
    with local_app(args, APP, keep_cluster=True) as base:
        yield base, kept_metrics_url()


def _stream(base: str, key: str, prompt: str) -> tuple[int, dict[str, Any]]:
    """Stream a chat; (content chunks received, the last event)."""
    words, last = 0, {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "stream": True, "max_tokens": MAX_TOKENS,
                            "messages": [{"role": "user", "content": prompt}]}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            last = json.loads(line.removeprefix("data: "))
            if last.get("choices"):
                words += 1
    return words, last


def _remaining_after(base: str, key: str) -> int:
    """The key's bucket as its next (tiny) request leaves it."""
    resp = httpx.post(f"{base}/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text
    return int(resp.headers["x-ratelimit-remaining-tokens"])


def _assert_charged(app: tuple[str, str], name: str, words: int, began: float) -> None:
    base, metrics_url = app
    prompt_tokens = len(PROMPT.split())
    text = scrape_until(metrics_url, [("ray_shunter_key_tokens_total", {"key_name": name, "kind": "completion"})])
    assert metric_total(text, "ray_shunter_key_tokens_total", key_name=name, kind="prompt") == prompt_tokens
    assert metric_total(text, "ray_shunter_key_tokens_total", key_name=name, kind="completion") == words
    remaining = _remaining_after(base, key=KEYS[name])
    probe = TOKENS_PER_MINUTE - _remaining_after(base, KEYS["probe"])  # what one such tiny request takes
    refilled = TOKENS_PER_MINUTE / 60 * (time.monotonic() - began)
    charged = TOKENS_PER_MINUTE - remaining - probe
    # Kept what it used (a refund of all would leave ~0 charged), gave back the unused reservation
    # (never settled, it would stay charged prompt + MAX_TOKENS).
    assert prompt_tokens + words - refilled - 2 <= charged <= prompt_tokens + words + 2, (charged, words, refilled)


def test_a_stream_cut_by_the_request_timeout_is_charged_what_it_produced(app):
    began = time.monotonic()
    words, last = _stream(app[0], KEYS["timeout"], PROMPT)
    assert last.get("error", {}).get("code") == "request_timeout", last
    assert 3 <= words < len(PROMPT.split())
    _assert_charged(app, "timeout", words, began)


def test_a_stream_cut_by_the_idle_timeout_is_charged_what_it_produced(app):
    began = time.monotonic()
    silent = PROMPT.replace("pace=0.5", f"pace={STREAM_IDLE_TIMEOUT_S * 2:g}")
    words, last = _stream(app[0], KEYS["idle"], silent)
    assert last.get("error", {}).get("code") == "stream_idle_timeout", last
    assert words >= 1
    _assert_charged(app, "idle", words, began)
