"""Graceful draining on a real Ray Serve app whose replicas run the FAKE engine (whose streams can be
made as long as a test needs).

- A config update takes the model from 2 replicas to 1 while streams run on both. A replica that leaves
  finishes its streams that end within the drain timeout; one still running at the timeout is ended
  with a `replica_drain_timeout` error event, never cut silently; streams on the replica that stays
  are untouched. The drains are exported as metrics. Each long stream runs on a key of its own: the one
  the drain cut is charged what it produced, as the settlement records it, no more and no less.
- Deleting the whole application drains it too: a stream in flight finishes whole.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from shunter.auth import new_key
from tests.e2e.live import metric_total, scrape_until
from tests.integration.local_app import FACTORY, kept_metrics_url, local_app

APP = "draining"
DRAIN_S = 6
HEADER = "x-shunter-replica"
KEYS = {name: new_key() for name in ("long-0", "long-1", "other")}


def _key_env(name: str) -> str:
    return "DRAINING_KEY_" + name.upper().replace("-", "_")


# The keys reach the gateway as a real deployment gives them, in the environment of the processes Ray
# starts; those inherit the cluster's, and the kept cluster starts after every module is imported.
os.environ.update({_key_env(name): key for name, key in KEYS.items()})


def _args(replicas: int) -> dict[str, Any]:
    return {"models": [{
        "name": "drained", "source": "fake:flaky", "accelerator": "cpu", "replicas": replicas,
        "cpu_cores_per_replica": 1, "routing": {"policy": "least_connections"},
        "draining": {"timeout_s": DRAIN_S},
    }], "auth": {"keys": [{"name": name, "key_env": _key_env(name), "tokens_per_minute": 10 ** 6} for name in KEYS]}}


def _auth(key: str = KEYS["other"]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class Outcome:
    replica: str
    events: list[str]
    prompt_words: int

    @property
    def words(self) -> int:
        """Content chunks received (the final usage chunk and error events carry no choice)."""
        return sum(1 for e in self.events if e.startswith("data: {")
                   and json.loads(e.removeprefix("data: ")).get("choices"))

    @property
    def complete(self) -> bool:
        return bool(self.events) and self.events[-1] == "data: [DONE]"

    @property
    def error_code(self) -> str | None:
        if self.complete or not self.events:
            return None
        return json.loads(self.events[-1].removeprefix("data: ")).get("error", {}).get("code")


def _stream(base: str, seconds: float, key: str = KEYS["other"], running: threading.Event | None = None) -> Outcome:
    """A stream of `seconds`; `running` is set once its first chunk has come (a replica is running it)."""
    words = int(seconds / 0.25)
    events: list[str] = []
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=120, headers=_auth(key), json={
                "model": "drained", "stream": True,
                "messages": [{"role": "user", "content": "pace=0.25 " + "w " * words}]}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if running is not None:
                        running.set()
    finally:
        if running is not None:
            running.set()  # a failed stream must not leave the test waiting for it
    return Outcome(resp.headers[HEADER], events, words + 1)


def _start_stream(pool: ThreadPoolExecutor, base: str, seconds: float, key: str = KEYS["other"]) -> Future[Outcome]:
    """Start a stream and return once a replica is running it, so that the next one is routed knowing it
    (least connections spreads the streams over the replicas)."""
    running = threading.Event()
    future = pool.submit(_stream, base, seconds, key, running)
    assert running.wait(60), "the stream never started"
    return future


@pytest.fixture(scope="module")
def app() -> Iterator[tuple[str, str]]:
    with local_app(_args(2), APP, keep_cluster=True) as base:
        yield base, kept_metrics_url()


def _replicas_serving(base: str, requests: int = 8) -> set[str]:
    seen = set()
    for _ in range(requests):
        resp = httpx.post(f"{base}/v1/chat/completions", timeout=30, headers=_auth(),
                          json={"model": "drained", "messages": [{"role": "user", "content": "who is there"}]})
        assert resp.status_code == 200, resp.text
        seen.add(resp.headers[HEADER])
    return seen


def test_leaving_replicas_finish_their_streams_and_abort_only_past_the_drain_timeout(app):
    from ray import serve

    from shunter.config import parse_config
    from shunter.deployments.app import assemble

    base, metrics_url = app
    before = _replicas_serving(base)
    assert len(before) == 2
    with ThreadPoolExecutor(4) as pool:
        longs: list[Future[Outcome]] = []
        shorts: list[Future[Outcome]] = []
        for i in range(2):  # one long and one short stream on each replica (least connections)
            longs.append(_start_stream(pool, base, 40, KEYS[f"long-{i}"]))
        for _ in range(2):
            shorts.append(_start_stream(pool, base, 4))
        serve.run(assemble(parse_config(_args(1)), engine_factory=FACTORY), name=APP, route_prefix="/")
        after = _replicas_serving(base)
        long_outcomes = [f.result() for f in longs]
        short_outcomes = [f.result() for f in shorts]
    assert len(after) == 1
    assert {o.replica for o in long_outcomes} == before, "the long streams ran on both replicas"
    left = before - after
    assert left, "a replica left"
    for outcome in short_outcomes:
        assert outcome.complete, f"a stream shorter than the drain timeout was cut: {outcome.events[-1:]}"
    for outcome in long_outcomes:
        if outcome.replica in left:
            assert outcome.error_code == "replica_drain_timeout", outcome.events[-1:]
        else:
            assert outcome.complete, outcome.events[-1:]
    scrape_until(metrics_url, [("ray_shunter_drain_aborted_total", {"model": "drained"}),
                               ("ray_shunter_drain_seconds_count", {"model": "drained"})])
    cut = [(i, o) for i, o in enumerate(long_outcomes) if o.replica in left]
    assert cut and all(0 < o.words < o.prompt_words - 1 for _, o in cut), "the drain cut the stream mid-way"
    for i, outcome in cut:  # its key is charged what the stream produced, no more, no less
        wanted = [("ray_shunter_key_tokens_total", {"key_name": f"long-{i}", "kind": "completion"})]
        text = scrape_until(metrics_url, wanted)
        assert metric_total(text, "ray_shunter_key_tokens_total", key_name=f"long-{i}", kind="prompt") == \
            outcome.prompt_words
        assert metric_total(text, *wanted[0][:1], **wanted[0][1]) == outcome.words


def test_deleting_the_application_lets_a_stream_in_flight_finish(app):
    from ray import serve

    base, _ = app
    result: list[Outcome] = []
    running = threading.Event()
    reader = threading.Thread(target=lambda: result.append(_stream(base, 4, running=running)))
    reader.start()
    assert running.wait(60), "the stream never started"
    serve.delete(APP)  # with the stream in flight
    reader.join(timeout=60)
    assert result and result[0].complete, result[0].events[-1:] if result else "no answer"
