"""Circuit breakers and failover on a real Ray Serve app whose two replicas run the FAKE engine.

Each test switches one replica into a fault (the engine raises, answers 500, or hangs) while requests
keep coming, and checks what a client sees: no request that the healthy replica could serve fails,
the faulty replica stops getting traffic once its breaker opens (it sees at most `consecutive_failures`
attempts), and it gets traffic again after it recovers and the cooldown has passed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.live import scrape_until
from tests.integration.local_app import fault_dir, kept_metrics_url, local_app

FAILURES_TO_OPEN = 2
COOLDOWN_S = 3.0
REPLICA_TIMEOUT_S = 2.0
HEADER = "x-shunter-replica"


class Duo:
    """The running app, its two replica ids, and the fake engines' control directory."""

    def __init__(self, base: str, control: Path):
        self.base = base
        self.control = control
        self.replicas: list[str] = []
        self.metrics_url = ""

    def chat(self, content: str, timeout: float = 30) -> httpx.Response:
        return httpx.post(f"{self.base}/v1/chat/completions", timeout=timeout,
                          json={"model": "duo", "messages": [{"role": "user", "content": content}]})

    def set_mode(self, replica: str, mode: str) -> None:
        (self.control / replica).write_text(mode)

    def calls(self, replica: str) -> int:
        path = self.control / f"{replica}.calls"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def other(self, replica: str) -> str:
        (other,) = [r for r in self.replicas if r != replica]
        return other

    def wait_serving(self, replica: str, timeout_s: float = 30) -> None:
        """Send requests until `replica` answers one (after a cooldown, a probe must reach it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            resp = self.chat("are you back")
            assert resp.status_code == 200, resp.text
            if resp.headers[HEADER] == replica:
                return
            time.sleep(0.2)
        raise AssertionError(f"replica {replica} never served again")


@pytest.fixture(scope="module")
def duo() -> Iterator[Duo]:
    args = {
        "models": [{
            "name": "duo", "source": "fake:flaky", "accelerator": "cpu", "replicas": 2,
            "cpu_cores_per_replica": 1,
            "routing": {
                "replica_timeout_s": REPLICA_TIMEOUT_S,
                "breaker": {"consecutive_failures": FAILURES_TO_OPEN, "cooldown_s": COOLDOWN_S},
            },
        }],
    }
    with local_app(args, "breakers", keep_cluster=True) as base:
        app = Duo(base, fault_dir())
        app.metrics_url = kept_metrics_url()
        seen: set[str] = set()
        for _ in range(60):
            resp = app.chat("hello")
            assert resp.status_code == 200, resp.text
            seen.add(resp.headers[HEADER])
            if len(seen) == 2:
                break
        app.replicas = sorted(seen)
        assert len(app.replicas) == 2, "both replicas should get traffic when all is well"
        yield app


@pytest.mark.parametrize("fault", ["error", "fail500", "hang"])
def test_faulty_replica_is_ejected_without_failing_requests_and_comes_back(duo, fault):
    bad, good = duo.replicas[0], duo.other(duo.replicas[0])
    duo.set_mode(bad, fault)
    try:
        before = duo.calls(bad)
        served = []
        for i in range(12):
            resp = duo.chat(f"request {i}")
            assert resp.status_code == 200, f"request {i} failed although {good} was healthy: {resp.text}"
            served.append(resp.headers[HEADER])
        assert set(served) == {good}, "a failed attempt is retried on the other replica"
        attempts = duo.calls(bad) - before
        assert 1 <= attempts <= FAILURES_TO_OPEN, f"open breaker should keep traffic away ({attempts} attempts)"
    finally:
        duo.set_mode(bad, "ok")
    time.sleep(COOLDOWN_S)
    duo.wait_serving(bad)


def test_client_errors_never_open_a_breaker(duo):
    total_before = sum(duo.calls(r) for r in duo.replicas)
    for _ in range(3 * FAILURES_TO_OPEN):
        resp = duo.chat("BAD input")
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    assert sum(duo.calls(r) for r in duo.replicas) - total_before == 3 * FAILURES_TO_OPEN, "4xx is not retried"
    for replica in duo.replicas:
        duo.wait_serving(replica, timeout_s=15)


def test_every_replica_failing_gives_503_at_once_then_recovers(duo):
    for replica in duo.replicas:
        duo.set_mode(replica, "error")
    try:
        statuses = []
        for _ in range(2 * FAILURES_TO_OPEN + 2):
            resp = duo.chat("anyone there")
            statuses.append(resp.status_code)
            assert resp.status_code == 503 and int(resp.headers["retry-after"]) >= 1, resp.text
            if resp.json()["error"]["code"] == "replicas_unavailable":
                break
        else:
            pytest.fail(f"breakers never all opened: {statuses}")
        calls = {replica: duo.calls(replica) for replica in duo.replicas}
        resp = duo.chat("still nobody?")
        assert {replica: duo.calls(replica) for replica in duo.replicas} == calls, \
            "an all-open model answers without sending the request to any replica (so at once)"
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "replicas_unavailable"
        assert 1 <= int(resp.headers["retry-after"]) <= COOLDOWN_S + 1
    finally:
        for replica in duo.replicas:
            duo.set_mode(replica, "ok")
    time.sleep(COOLDOWN_S)
    for replica in duo.replicas:
        duo.wait_serving(replica)


def test_stream_from_a_hanging_replica_fails_over_before_the_first_byte(duo):
    bad, good = duo.replicas[1], duo.other(duo.replicas[1])
    duo.set_mode(bad, "hang")
    try:
        for i in range(4):
            with httpx.stream("POST", f"{duo.base}/v1/chat/completions", timeout=30, json={
                    "model": "duo", "stream": True,
                    "messages": [{"role": "user", "content": f"one two three {i}"}]}) as resp:
                assert resp.status_code == 200 and resp.headers[HEADER] == good
                events = [line for line in resp.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) == 5
    finally:
        duo.set_mode(bad, "ok")
    time.sleep(COOLDOWN_S)
    duo.wait_serving(bad)


def test_a_whole_reply_slower_than_the_replica_timeout_is_served_once_and_counts_as_no_failure(duo):
    """A non-streamed reply that takes longer than routing.replica_timeout_s (2 s here): the replica says
    it is still working, so the gateway neither retries it elsewhere nor holds it against the replica."""
    words = "pace=0.4 " + " ".join(f"w{i}" for i in range(9))  # ten words at 0.4 s: about 4 s
    before = {r: duo.calls(r) for r in duo.replicas}
    resp = duo.chat(words, timeout=60)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == words, resp.text
    assert sum(duo.calls(r) - before[r] for r in duo.replicas) == 1, "served once, never retried"
    listed = httpx.get(f"{duo.base}/admin/models/duo/replicas", timeout=30).json()["replicas"]
    assert all(r["breaker"] == "closed" for r in listed), listed


def test_an_engine_error_inside_a_200_stream_counts_as_the_replicas_failure(duo):
    """vLLM reports an engine-core death mid-stream as an error event and then [DONE]: the client sees
    the error event, and the breaker counts a failure (two in a row open it)."""
    for i in range(2 * FAILURES_TO_OPEN):
        with httpx.stream("POST", f"{duo.base}/v1/chat/completions", timeout=30, json={
                "model": "duo", "stream": True,
                "messages": [{"role": "user", "content": f"one two three INBAND four {i}"}]}) as resp:
            if resp.status_code == 503:  # both breakers already open
                break
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert any('"error"' in e for e in events) and events[-1] == "data: [DONE]", events
    listed = httpx.get(f"{duo.base}/admin/models/duo/replicas", timeout=30).json()["replicas"]
    assert any(r["breaker"] != "closed" for r in listed), listed
    time.sleep(COOLDOWN_S)
    for replica in duo.replicas:
        duo.wait_serving(replica)


def test_routing_and_breaker_metrics_are_exported_through_ray(duo):
    """After the faults above: breakers opened and closed, retries and breaker skips were counted.
    Ray exports application metrics with its own `ray_` prefix."""
    wanted = {
        ("ray_shunter_breaker_transitions_total", "to", "open"),
        ("ray_shunter_breaker_transitions_total", "to", "closed"),
        ("ray_shunter_routing_decisions_total", "reason", "retry"),
        ("ray_shunter_routing_decisions_total", "reason", "breaker_skip"),
    }
    text = scrape_until(duo.metrics_url, [(name, {"model": "duo", key: value}) for name, key, value in wanted])
    assert "ray_shunter_breaker_state{" in text and "ray_shunter_routing_prefix_match_ratio_bucket{" in text
