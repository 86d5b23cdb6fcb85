"""Platform behaviour under faults the real engine cannot show on demand (fake engine, real Ray Serve).

- a model none of whose replicas can start: its requests get 503 with Retry-After at once, /ready
  says which model and why, and the other model keeps serving;
- a model whose replicas are all full: a request waits at most `gateway.queue_timeout_s` for one, then
  gets 503 with Retry-After (never an unbounded wait);
- a replica that dies mid-stream: the client sees the chunks already sent and then an explicit error
  event, never a silently truncated stream; Ray Serve replaces the replica and the model serves again;
- `gateway.limits`: a reply slower than `request_timeout_s` is a 504, a stream running past it or silent
  for `stream_idle_timeout_s` ends with an error event naming which (the fake engine's `pace=` words make
  a reply as slow as needed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.local_app import local_app

QUEUE_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 8.0
STREAM_IDLE_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def fault_app() -> Iterator[str]:
    args = {
        "models": [
            # one request at a time, so a second one has to queue
            {"name": "flaky", "source": "fake:flaky", "accelerator": "cpu", "max_ongoing_requests": 1},
            {"name": "broken", "source": "fake:never-starts", "accelerator": "cpu"},
        ],
        "gateway": {"queue_timeout_s": QUEUE_TIMEOUT_S, "body_timeout_s": 5,
                    "limits": {"request_timeout_s": REQUEST_TIMEOUT_S,
                               "stream_idle_timeout_s": STREAM_IDLE_TIMEOUT_S}},
    }
    # Not blocking: the app as a whole never reaches RUNNING, since `broken` never starts.
    with local_app(args, "faults", blocking=False, keep_cluster=True) as base:
        _wait(lambda: _ready_models(base).get("flaky", {}).get("ready") is True, 120, "flaky never became ready")
        yield base


def _ready_models(base: str) -> dict:
    try:
        resp = httpx.get(f"{base}/ready", timeout=30)
    except httpx.HTTPError:
        return {}
    return resp.json().get("models", {}) if resp.headers.get("content-type", "").startswith("application/json") \
        else {}


def _wait(predicate, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1)
    raise AssertionError(message)


def _chat(base: str, model: str, content: str, stream: bool = False, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=timeout,
                      json={"model": model, "messages": [{"role": "user", "content": content}], "stream": stream})


def _deployment_status(name: str) -> str:
    from ray import serve

    return serve.status().applications["faults"].deployments[name].status


def test_model_that_never_starts_gets_503_with_retry_after(fault_app):
    """Once Ray has given up on the model's replicas, its requests are answered at once. (While a replica
    is still starting, a request waits at most a bounded time: tests/integration/test_admission.py.)"""
    _wait(lambda: _deployment_status("model-broken") == "DEPLOY_FAILED", 120, "broken never declared failed")
    resp = _chat(fault_app, "broken", "hello")
    assert resp.status_code == 503 and resp.headers.get("retry-after"), (resp.headers, resp.text)
    assert resp.json()["error"]["code"] == "model_unavailable", "answered at once, not after the queue timeout"


def test_full_replicas_give_503_after_the_queue_timeout(fault_app):
    """The one slot is held by a stream that would run for minutes (a word a second), and the second
    request's client waits two at most: only the queue timeout can answer it, while the slot is still
    held. The admitted stream goes on undisturbed. No clock is read: the order of events shows the bound."""
    words = [f"w{i}" for i in range(200)]
    with httpx.stream("POST", f"{fault_app}/v1/chat/completions", timeout=60, json={
            "model": "flaky", "stream": True,
            "messages": [{"role": "user", "content": "pace=1 " + " ".join(words)}]}) as busy:
        lines = (line for line in busy.iter_lines() if line.startswith("data: "))
        next(lines)  # the one replica slot is taken
        resp = _chat(fault_app, "flaky", "me too", timeout=120)
        assert resp.status_code == 503 and resp.headers["retry-after"]
        error = resp.json()["error"]
        assert error["code"] == "queue_timeout" and f"within {QUEUE_TIMEOUT_S:g}s" in error["message"], error
        after = json.loads(next(lines).removeprefix("data: "))  # the admitted stream goes on, undisturbed
        assert after["choices"][0]["delta"]["content"].strip() in words, after
    # Leaving the stream gives its slot back (the gateway cancels the replica's work).
    _wait(lambda: _chat(fault_app, "flaky", "free again").status_code == 200, 60, "the slot was never freed")


def test_ready_names_the_model_that_is_not_ready(fault_app):
    resp = httpx.get(f"{fault_app}/ready", timeout=30)
    body = resp.json()
    assert resp.status_code == 503 and resp.headers["retry-after"]
    assert body["models"]["flaky"]["ready"] is True
    assert body["models"]["broken"]["ready"] is False and body["models"]["broken"]["reason"]


def test_other_model_keeps_serving(fault_app):
    resp = _chat(fault_app, "flaky", "one two three")
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "one two three"


def test_replica_death_mid_stream_ends_with_an_error_event(fault_app):
    with httpx.stream("POST", f"{fault_app}/v1/chat/completions", timeout=60, json={
            "model": "flaky", "stream": True,
            "messages": [{"role": "user", "content": "alpha beta gamma DIE delta epsilon"}]}) as resp:
        assert resp.status_code == 200
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    words = [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]]
    assert words == ["alpha ", "beta ", "gamma "]
    assert "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert error["code"] == "stream_interrupted" and "flaky" in error["message"]


def test_model_serves_again_after_its_replica_died(fault_app):
    _wait(lambda: _chat(fault_app, "flaky", "back again").status_code == 200, 120, "flaky never came back")
    with httpx.stream("POST", f"{fault_app}/v1/chat/completions", timeout=60, json={
            "model": "flaky", "stream": True, "messages": [{"role": "user", "content": "a b c d e"}]}) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 6


def _events(resp: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in resp.iter_lines()
            if line.startswith("data: {")]


def test_a_reply_slower_than_the_request_timeout_is_a_504(fault_app):
    # The reply would take 60 s; the client waits 40 s at most: a 504 at all means the gateway answered
    # at its timeout, not at the reply's end.
    resp = _chat(fault_app, "flaky", "pace=2 " + " ".join(f"w{i}" for i in range(30)), timeout=5 * REQUEST_TIMEOUT_S)
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "request_timeout" and f"{REQUEST_TIMEOUT_S:g}s" in resp.text
    # The replica's work was cancelled with it: its one slot comes back well before the reply's 60 s.
    _wait(lambda: _chat(fault_app, "flaky", "after the timeout").status_code == 200, 30,
          "the timed-out reply kept its slot")


def test_a_stream_past_the_request_timeout_ends_with_an_error_event(fault_app):
    with httpx.stream("POST", f"{fault_app}/v1/chat/completions", timeout=60, json={
            "model": "flaky", "stream": True, "messages": [
                {"role": "user", "content": "pace=1 " + " ".join(f"w{i}" for i in range(30))}]}) as resp:
        assert resp.status_code == 200
        events = _events(resp)
    words = [e for e in events if "choices" in e]
    assert 3 <= len(words) < 30, "it streamed until the timeout, and no further"
    assert events[-1]["error"]["code"] == "request_timeout", events[-1]


def test_a_stream_silent_past_the_idle_timeout_ends_with_an_error_event(fault_app):
    with httpx.stream("POST", f"{fault_app}/v1/chat/completions", timeout=60, json={
            "model": "flaky", "stream": True, "messages": [
                {"role": "user", "content": f"pace={STREAM_IDLE_TIMEOUT_S * 2:g} one two three"}]}) as resp:
        assert resp.status_code == 200
        events = _events(resp)
    assert events[-1]["error"]["code"] == "stream_idle_timeout", events
    assert f"{STREAM_IDLE_TIMEOUT_S:g}s" in events[-1]["error"]["message"]
    assert _chat(fault_app, "flaky", "still serving").status_code == 200
