"""A client that leaves stops the work, on every endpoint, whole and streamed, through the direct ingress
(HAProxy in front of the gateways' own HTTP servers), on the keyed app (tests/e2e/keyed_app.py).

Clients are httpx's, as real ones are: they send a request's body in a packet of its own after its headers,
the case in which HAProxy's request splicing used to lose the client's close (shunter.ingress). The keyed
app's limits keep every request small (8 tokens, n <= 2, 200 prompt tokens), so the work that would run
long is a burst of such requests, or one completions batch of many one-token prompts. The clients leave
0.3 s after the engine has started on it (a whole reply while it waits, a stream mid-read). Then: the
engine holds none of the requests within a few seconds, each is settled once: a 499 for its key when its
client left, a 200 for a reply its client read whole or that was finished as its client left (a few at
most: never a burst run to its end for nobody), the key is charged more than nothing and less than every
token the burst could have made, and the platform serves the next request normally. A whole completions batch left after 2.5 s is charged the completion tokens its replica
had reported by then (shunter.engine_usage).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from .keyed_app import APP, FULL, LEAVER, MAX_N, MAX_PROMPT_TOKENS, MAX_TOKENS, TIMEOUT_S
from .live import CHAT_MODEL, EMBED_MODEL, metric_total

pytestmark = pytest.mark.own_app

LEAVE_S = 0.3  # how long the clients stay once the engine has started on their requests
IDLE_WITHIN_S = 10.0  # the engine drops a gone client's requests well within this (the goal: a second)
HEADERS = {"Authorization": f"Bearer {LEAVER}"}
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "responses": "/v1/responses",
         "messages": "/v1/messages", "embedding": "/v1/embeddings"}
_measured: dict[str, float] = {}  # case -> seconds from the clients leaving to the engine holding nothing


@pytest.fixture(scope="module")
def app(keyed_app_url) -> str:
    yield keyed_app_url
    print("\nfrom the clients leaving to the engine holding none of their requests:",
          ", ".join(f"{case} {seconds:.2f}s" for case, seconds in _measured.items()))


def _story(i: int) -> str:
    """A prompt of about 130 tokens (with the chat template), unlike every other: the key's prompt cache
    would shorten a repeat."""
    return f"Story {i}: " + " ".join(f"the ship number {i * 100 + j} sailed on" for j in range(12))


def _burst(endpoint: str, stream: bool) -> list[dict[str, Any]]:
    """Bodies that together keep the engine busy for seconds."""
    if endpoint == "chat":  # 16 requests of 2 choices: twice the sequences the engine runs at once
        return [{"model": CHAT_MODEL, "messages": [{"role": "user", "content": _story(i)}], "n": MAX_N,
                 "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0, "stream": stream}
                for i in range(16)]
    if endpoint == "completion":  # one batch: 100 one-token prompts of 2 choices each, 1,600 tokens
        return [{"model": CHAT_MODEL, "prompt": ["Once"] * 100, "n": MAX_N, "max_tokens": MAX_TOKENS,
                 "ignore_eos": True, "temperature": 1.0, "stream": stream}]
    if endpoint == "responses":
        return [{"model": CHAT_MODEL, "input": _story(i), "max_output_tokens": MAX_TOKENS, "stream": stream}
                for i in range(24)]
    if endpoint == "messages":
        return [{"model": CHAT_MODEL, "messages": [{"role": "user", "content": _story(i)}], "max_tokens": MAX_TOKENS,
                 "stream": stream} for i in range(24)]
    # Embeddings: each request is at most 200 tokens in all (the prompt limit), an engine's few milliseconds,
    # and counts as one request per input at admission: a burst as big as admission takes at once.
    assert endpoint == "embedding" and not stream
    return [{"model": EMBED_MODEL, "input": [f"ship {i}"] * 8} for i in range(20)]


def _most_completion(endpoint: str, bodies: list[dict[str, Any]]) -> int:
    """Every completion token the requests could have made (none for embeddings, which make none: then
    nothing at all is allowed, so the bound is 1)."""
    if endpoint == "embedding":
        return 1
    return sum(MAX_TOKENS * int(body.get("n", 1)) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
               for body in bodies)


async def _send_and_leave(app: str, path: str, bodies: list[dict[str, Any]], model: str,
                          leave_s: float) -> tuple[list[str], int]:
    """Clients send `bodies` at once and leave `leave_s` after the engine has started on them (a whole
    reply's client while it waits, a stream's mid-read): each request's task is cancelled, which closes
    its connection. Returns what each client saw ("left", or the reply it got first) and the engine's
    request count as they left."""

    async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
        if body.get("stream"):
            async with client.stream("POST", f"{app}{path}", json=body) as resp:
                async for _ in resp.aiter_lines():
                    pass
                return f"read to its end: {resp.status_code}"
        resp = await client.post(f"{app}{path}", json=body)
        return f"answered before leaving: {resp.status_code} {resp.text[:200]}"

    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
    async with httpx.AsyncClient(headers=HEADERS, timeout=TIMEOUT_S, limits=limits) as client:
        tasks = [asyncio.ensure_future(one(client, body)) for body in bodies]
        deadline, busy = time.monotonic() + 30, 0
        while not busy and time.monotonic() < deadline and not all(t.done() for t in tasks):
            busy = await asyncio.to_thread(_engine_requests, model)
        await asyncio.sleep(leave_s)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return ["left" if isinstance(r, asyncio.CancelledError) else repr(r) if isinstance(r, BaseException) else r
            for r in results], busy


def _engine_requests(model: str) -> int:
    from ray import serve

    handle = serve.get_deployment_handle(f"model-{model}", app_name=APP)
    return handle.stats.remote().result(timeout_s=30)["unfinished_requests"]


def _wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _key_totals() -> dict[str, float]:
    """The leaving key's settled requests and charged tokens as the gateways export them."""
    from tests.integration.local_app import kept_metrics_url

    text = httpx.get(kept_metrics_url(), timeout=10).text
    labels = {"key_name": "leaver"}
    return {"499": metric_total(text, "ray_shunter_key_requests_total", status="499", **labels),
            "200": metric_total(text, "ray_shunter_key_requests_total", status="200", **labels),
            "prompt": metric_total(text, "ray_shunter_key_tokens_total", kind="prompt", **labels),
            "completion": metric_total(text, "ray_shunter_key_tokens_total", kind="completion", **labels)}


def _settled(settled_requests: float, timeout_s: float = 60, quiet_s: float = 1) -> dict[str, float]:
    """The key's totals once `settled_requests` requests are counted and two scrapes `quiet_s` apart agree:
    a request's status and tokens are recorded together when it settles, so the export (every 2 s in the
    suite's clusters) that brings the last count brings its tokens too. With no count to wait for, the
    scrapes must be further apart than an export, or two could read the same stale one."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        now = _key_totals()
        if now["499"] + now["200"] >= settled_requests and now == last:
            return now
        last = now
        time.sleep(quiet_s)
    raise AssertionError(f"the key's requests never settled at {settled_requests}: {last}")


_totals: list[dict[str, float]] = []  # the key's totals after the last test (only this module uses the key)
_open: list[bool] = []  # a test read its "before" and has not yet read its "after"


def _before() -> dict[str, float]:
    """The key's totals before a test: the last test's "after", or, first or after a test that failed before
    reading its own, a fresh reading once its late settlements have stopped arriving."""
    if not _totals or _open:
        _totals.append(_settled(0, quiet_s=3))
    _open[:] = [True]
    return _totals[-1]


def _after(before: dict[str, float], requests: int) -> dict[str, float]:
    _totals.append(_settled(before["499"] + before["200"] + requests))
    _open.clear()
    return _totals[-1]


CASES = [(endpoint, stream) for endpoint in ("chat", "completion", "responses", "messages", "embedding")
         for stream in (False, True) if not (endpoint == "embedding" and stream)]


@pytest.mark.parametrize(("endpoint", "stream"), CASES, ids=[f"{e}-{'stream' if s else 'whole'}" for e, s in CASES])
def test_a_client_that_leaves_stops_its_work_and_is_charged_what_was_produced(app, endpoint, stream):
    model = EMBED_MODEL if endpoint == "embedding" else CHAT_MODEL
    assert _wait_for(lambda: _engine_requests(model) == 0, 60), "the engine was busy before the test"
    before, bodies = _before(), _burst(endpoint, stream)
    # An embeddings burst is over in a moment: its clients leave as soon as the engine has started on it,
    # and those answered first are counted as answered.
    leave_s = 0.0 if endpoint == "embedding" else LEAVE_S
    outcomes, busy = asyncio.run(_send_and_leave(app, PATHS[endpoint], bodies, model, leave_s))
    left_at, left = time.monotonic(), outcomes.count("left")
    answered = len(bodies) - left
    # A request the engine finished before its client left is a 200 the client read whole: on a fast
    # engine the first of a burst of small requests can (eight tokens in the 0.3 s). Most must be left.
    whole = "read to its end: 200" if stream else "answered before leaving: 200 "
    assert sum(o.startswith(whole) for o in outcomes) == answered, outcomes
    assert left >= max(1, 0 if endpoint == "embedding" else len(bodies) // 2), outcomes
    assert busy > 0, "the engine never started on the requests: the test would prove nothing"
    assert _wait_for(lambda: _engine_requests(model) == 0, IDLE_WITHIN_S), \
        f"the engine still held requests {IDLE_WITHIN_S:g}s after their clients left"
    _measured[f"{endpoint}-{'stream' if stream else 'whole'}"] = time.monotonic() - left_at

    after = _after(before, len(bodies))
    settled = (after["499"] - before["499"], after["200"] - before["200"])
    # Each request settles once. A reply the engine finished in the instant its client left is a 200 written
    # to a closed connection: the server cannot know it went unread (CI's slower machine saw 1 and 2 of 24).
    # Such 200s are few: the engine dropped the rest (it held none within IDLE_WITHIN_S, above), as 499s.
    # An input's embedding takes the engine milliseconds, less than a hang-up takes to reach it: there any
    # of those left may be such a 200 (CI saw 12 of 20), and what must hold is that each settles once.
    unread = settled[1] - answered
    most_unread = left if endpoint == "embedding" else len(bodies) // 4
    assert sum(settled) == len(bodies) and settled[1] >= answered and unread <= most_unread, \
        ("each request settled once: a 499 for each client that left, but for the few finished as it left",
         settled, left, answered)
    # Charged what was produced: more than nothing, never every token the burst could have made (its
    # prompts as the engine counted them, which may be more than the door's estimate, and some completion).
    prompt, completion = after["prompt"] - before["prompt"], after["completion"] - before["completion"]
    assert prompt + completion > 0 and completion < _most_completion(endpoint, bodies), (prompt, completion)
    assert prompt <= MAX_PROMPT_TOKENS * len(bodies), prompt

    # The platform serves the next request normally (another key's: this one's totals stay as read).
    body = {**bodies[0], "stream": False}
    if endpoint == "completion":
        body["prompt"] = "Once upon a time"
    served = httpx.post(f"{app}{PATHS[endpoint]}", json=body, headers={"Authorization": f"Bearer {FULL}"},
                        timeout=TIMEOUT_S)
    assert served.status_code == 200, served.text


def test_a_whole_reply_left_mid_way_is_charged_the_completion_tokens_its_replica_reported(app):
    """A whole completions batch of 1,600 tokens, left 2.5 s after the engine started on it: its replica's
    heartbeats (every second) said what it had produced by then, and that is what the key pays."""
    assert _wait_for(lambda: _engine_requests(CHAT_MODEL) == 0, 60), "the engine was busy before the test"
    before, bodies = _before(), _burst("completion", stream=False)
    outcomes, busy = asyncio.run(_send_and_leave(app, PATHS["completion"], bodies, CHAT_MODEL, 2.5))
    left = time.monotonic()
    assert outcomes == ["left"] and busy > 0, outcomes
    assert _wait_for(lambda: _engine_requests(CHAT_MODEL) == 0, IDLE_WITHIN_S)
    _measured["completion-whole left after 2.5s"] = time.monotonic() - left
    after = _after(before, 1)
    assert after["499"] - before["499"] == 1
    completion = after["completion"] - before["completion"]
    assert 0 < completion < MAX_TOKENS * MAX_N * len(bodies[0]["prompt"]), completion
    assert after["prompt"] - before["prompt"] == len(bodies[0]["prompt"]), "its 100 one-token prompts"
    # The key's quota shows it: its next request is served, with the rate-limit headers.
    served = httpx.post(f"{app}{PATHS['chat']}", headers=HEADERS, timeout=TIMEOUT_S, json={
        "model": CHAT_MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": MAX_TOKENS})
    assert served.status_code == 200 and int(served.headers["x-ratelimit-remaining-tokens"]) > 0, served.text
