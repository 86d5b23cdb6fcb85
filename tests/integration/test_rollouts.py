"""Blue-green rollouts on a real local Ray Serve app, under steady load, with the FAKE engine
(tests/integration/fault_engine.py) standing in for versions that must misbehave on demand: one that
never starts, one that answers 500, one far slower. Real engines roll out in tests/e2e/test_rollouts.py.

Each rollout is driven through the gateway's admin API, as `shunter rollout` does, and each must leave
the old version serving throughout: no request the old version could serve fails, no stream is cut.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.integration.fake_app import fake_engine_app

APP = "rollouts"
MODEL = "echo"
ROLLOUT = {"steps": [10, 50, 100], "hold_s": 3, "max_hold_s": 60, "ready_timeout_s": 120,
           "gates": {"min_requests": 5, "max_error_rate_increase": 0.05, "max_ttft_p95_ratio": 3,
                     "max_e2e_p95_ratio": 3, "latency_slack_s": 0.3}}
ARGS = {
    "models": [{
        "name": MODEL,
        "versions": [
            {"name": "v1", "source": "fake:flaky", "weight": 100},
            {"name": "v2", "source": "fake:flaky"},
            {"name": "never", "source": "fake:never-starts"},
            {"name": "broken", "source": "fake:broken"},
            {"name": "slow", "source": "fake:slow"},
        ],
        "rollout": ROLLOUT,
        "routing": {"policy": "least_connections"},
        "draining": {"timeout_s": 30},
    }],
    "gateway": {"queue_timeout_s": 20},
}


@dataclass
class Load:
    """Clients in threads sending until stopped, half of it streamed; each client holds a conversation
    (the `user` field) for five requests, then starts the next."""

    base: str
    clients: int = 4
    results: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, client: int) -> None:
        with httpx.Client(base_url=self.base, timeout=60) as http:
            n = 0
            while not self.stop.is_set():
                n += 1
                stream = n % 2 == 0
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"hello number {n} from {client}"}],
                        "stream": stream, "user": f"client-{client}-{n // 5}"}
                result: dict[str, Any] = {"conversation": body["user"], "stream": stream}
                try:
                    if stream:
                        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                            text = "".join(resp.iter_text())
                        result.update(status=resp.status_code, whole="data: [DONE]" in text and '"error"' not in text)
                    else:
                        resp = http.post("/v1/chat/completions", json=body)
                        result.update(status=resp.status_code, whole=resp.status_code == 200)
                    result["version"] = resp.headers.get("x-shunter-version")
                except httpx.HTTPError as exc:
                    result.update(status=None, whole=False, error=repr(exc))
                self.results.append(result)

    def failures(self) -> list[dict[str, Any]]:
        return [r for r in self.results if r["status"] != 200 or not r["whole"]]


@pytest.fixture(scope="module")
def app() -> Iterator[str]:
    with fake_engine_app(ARGS, APP) as base:
        yield base


@pytest.fixture
def load(app: str) -> Iterator[Load]:
    running = Load(app)
    threads = [threading.Thread(target=running.run, args=(i,), daemon=True) for i in range(running.clients)]
    for t in threads:
        t.start()
    yield running
    running.stop.set()
    for t in threads:
        t.join(timeout=90)


def _start(base: str, to: str, **overrides: Any) -> dict[str, Any]:
    resp = httpx.post(f"{base}/admin/rollouts/{MODEL}", json={"to": to, **overrides}, timeout=30)
    assert resp.status_code == 202, resp.text
    return resp.json()


def _wait_done(base: str, timeout_s: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = httpx.get(f"{base}/admin/rollouts/{MODEL}", timeout=30).json()
        if status["rollout"] and status["rollout"]["phase"] == "done":
            return status
        time.sleep(1)
    raise AssertionError(f"rollout not done after {timeout_s}s: {status}")


def _replicas(deployment: str) -> int:
    from ray import serve

    dep = serve.status().applications[APP].deployments[f"model-{MODEL}--{deployment}"]
    return sum(dep.replica_states.values())


def _timeline(status: dict[str, Any]) -> str:
    start = status["rollout"]["history"][0]["at"]
    return "\n".join(f"  +{e['at'] - start:6.1f}s {e['phase']:12} {e['weights']} {e['reason']}"
                     for e in status["rollout"]["history"])


def test_a_good_version_is_promoted_and_the_old_one_removed(app, load):
    time.sleep(2)  # some traffic on v1 first
    _start(app, "v2")
    status = _wait_done(app)
    print("\ngood rollout:\n" + _timeline(status))
    rollout = status["rollout"]
    assert rollout["outcome"] == "promoted", _timeline(status)
    assert status["weights"] == [{"version": "v2", "weight": 100.0}, {"version": "v1", "weight": 0.0}]
    assert status["live"] == ["v2"] and _replicas("v1") == 0 and _replicas("v2") == 1
    steps = [e["weights"]["v2"] for e in rollout["history"] if e["phase"] == "shifting"]
    assert steps == [10, 50, 100], "every step was taken in order"
    time.sleep(2)
    load.stop.set()
    time.sleep(1)
    assert not load.failures(), load.failures()[:5]
    versions = [r["version"] for r in load.results]
    assert versions[-1] == "v2" and "v1" in versions
    conversations: dict[str, list[str]] = {}
    for r in load.results:
        conversations.setdefault(r["conversation"], []).append(r["version"])
    for seen in conversations.values():  # a conversation moves from v1 to v2 at most once, never back
        assert seen == sorted(seen, key=lambda v: v == "v2"), seen


@pytest.mark.parametrize("bad, why", [("never", "failed to start"), ("broken", "error rate"),
                                      ("slow", "p95")])
def test_a_bad_version_is_rolled_back_and_the_old_one_never_stops(app, load, bad, why):
    serving = httpx.get(f"{app}/admin/rollouts/{MODEL}", timeout=30).json()["live"][0]
    _start(app, bad)
    status = _wait_done(app)
    print(f"\nrollout to {bad}:\n" + _timeline(status))
    assert status["rollout"]["outcome"] == "rolled_back", _timeline(status)
    assert why in status["rollout"]["history"][-2]["reason"], _timeline(status)
    assert status["live"] == [serving] and _replicas(bad) == 0
    load.stop.set()
    time.sleep(1)
    # A failed first attempt on the new version is served by the old one: the client sees no error.
    assert not load.failures(), load.failures()[:5]
    assert {r["version"] for r in load.results} <= {serving, bad}


def test_commands_are_checked(app):
    for body, code in (({"to": "v9"}, 409), ({}, 400), ({"to": "v1", "steps": [50, 10]}, 400)):
        resp = httpx.post(f"{app}/admin/rollouts/{MODEL}", json=body, timeout=30)
        assert resp.status_code == code, resp.text
        assert resp.json()["error"]["message"]
    assert httpx.post(f"{app}/admin/rollouts/nope", json={"to": "v1"}, timeout=30).status_code == 404
