"""Blue-green rollouts on a real local Ray Serve app, under steady load, with the FAKE engine
(tests/integration/fault_engine.py) standing in for versions that must misbehave on demand: one that
never starts, one far slower (the one that answers 500 is rolled back in tests/e2e/test_observability.py). Real engines roll out in tests/e2e/test_rollouts.py.

Each rollout is driven through the gateway's admin API, as `shunter rollout` does, and each must leave
the old version serving throughout: no request the old version could serve fails, no stream is cut.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.local_app import ROOT, local_app
from tests.rollout_client import Load, start_rollout, timeline, wait_done

APP = "rollouts"
MODEL = "echo"
ROLLOUT = {"steps": [10, 50, 100], "hold_s": 3, "max_hold_s": 60, "ready_timeout_s": 120,
           "gates": {"min_requests": 5, "max_error_rate_increase": 0.05, "max_ttft_p95_ratio": 3,
                     "max_e2e_p95_ratio": 3, "latency_slack_s": 0.6}}
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


@pytest.fixture(scope="module")
def app() -> Iterator[str]:
    with local_app(ARGS, APP, keep_cluster=True) as base:
        yield base


@pytest.fixture
def load(app: str) -> Iterator[Load]:
    running = Load(app, MODEL)
    running.start()
    yield running
    running.finish(timeout_s=90)


def _replicas(deployment: str) -> int:
    from ray import serve

    dep = serve.status().applications[APP].deployments[f"model-{MODEL}--{deployment}"]
    return sum(dep.replica_states.values())


def _cli(app: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shunter.cli", *args, "--url", app], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_killing_the_cli_and_the_control_actor_mid_rollout_loses_nothing(app, load):
    import ray

    from shunter.ops.control import NAMESPACE, actor_name

    serving = httpx.get(f"{app}/admin/rollouts/{MODEL}", timeout=30).json()["live"][0]
    other = "v1" if serving == "v2" else "v2"
    watching = _cli(app, "rollout", "start", MODEL, "--to", other)
    seen: list[str] = []

    def read() -> None:  # the CLI follows the timeline; stop reading once traffic has started moving
        for line in watching.stdout:
            seen.append(line)
            if "shifting" in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=180)  # a CLI that never prints "shifting" fails the test here, not the suite
    watching.kill()
    watching.wait(timeout=30)
    assert any("shifting" in line for line in seen), "".join(seen)
    # The rollout's process dies too; Ray restarts it and it reloads the rollout from the KV store.
    ray.kill(ray.get_actor(actor_name(APP), namespace=NAMESPACE), no_restart=False)

    again = _cli(app, "rollout", "status", MODEL, "--follow")
    out, _ = again.communicate(timeout=180)
    assert again.returncode == 0, out
    assert f"{MODEL}: promoted; weights {other}=100, {serving}=0" in out, out
    assert out.count("shifting") == 3, "the second CLI printed the whole timeline, every step"
    status = wait_done(app, MODEL)
    assert [e["weights"][other] for e in status["rollout"]["history"] if e["phase"] == "shifting"] == [10, 50, 100]
    assert status["live"] == [other]
    load.finish()  # every request in flight has ended: its outcome is among the results
    assert not load.failures(), load.failures()[:5]


# The error-rate gate's rollback (version `broken`) is shown once, by tests/e2e/test_observability.py (the
# same fake broken version beside a real engine, no client error, and the dashboards' gate panels).
@pytest.mark.parametrize("bad, why", [("never", "failed to start"), ("slow", "p95")])
def test_a_bad_version_is_rolled_back_and_the_old_one_never_stops(app, load, bad, why):
    serving = httpx.get(f"{app}/admin/rollouts/{MODEL}", timeout=30).json()["live"][0]
    start_rollout(app, MODEL, bad)
    status = wait_done(app, MODEL)
    print(f"\nrollout to {bad}:\n" + timeline(status))
    assert status["rollout"]["outcome"] == "rolled_back", timeline(status)
    assert why in status["rollout"]["history"][-2]["reason"], timeline(status)
    assert status["live"] == [serving] and _replicas(bad) == 0
    load.finish()  # every request in flight has ended: its outcome is among the results
    # A failed first attempt on the new version is served by the old one: the client sees no error.
    assert not load.failures(), load.failures()[:5]
    assert {r["version"] for r in load.results} <= {serving, bad}


def test_commands_are_checked(app):
    for body, code in (({"to": "v9"}, 409), ({}, 400), ({"to": "v1", "steps": [50, 10]}, 400)):
        resp = httpx.post(f"{app}/admin/rollouts/{MODEL}", json=body, timeout=30)
        assert resp.status_code == code, resp.text
        assert resp.json()["error"]["message"]
    assert httpx.post(f"{app}/admin/rollouts/nope", json={"to": "v1"}, timeout=30).status_code == 404


def test_ready_is_503_while_the_only_version_taking_traffic_cannot_start(app):
    """An operator moves all traffic to a version that never starts: the model has nothing able to serve,
    and /ready must say so (with why) rather than `ready: true` while every request fails (they get a 503
    queue_timeout with Retry-After: tests/integration/test_faults.py)."""
    def weights(split: dict[str, float]) -> None:
        resp = httpx.put(f"{app}/admin/models/{MODEL}/weights", json={"weights": split}, timeout=60)
        assert resp.status_code == 200, resp.text

    weights({"never": 100, "v1": 0})
    try:
        ready = httpx.get(f"{app}/ready", timeout=60)
        assert ready.status_code == 503 and ready.headers.get("Retry-After"), ready.text
        echo = ready.json()["models"][MODEL]
        assert echo["ready"] is False and "version never" in echo["reason"], echo
    finally:
        weights({"v1": 100, "never": 0})
    deadline = time.monotonic() + 120
    while httpx.get(f"{app}/ready", timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "v1 did not come back"
        time.sleep(1)


def _shunter(app: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "shunter.cli", *args, "--url", app], cwd=ROOT, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _status(app: str) -> dict:
    return httpx.get(f"{app}/admin/rollouts/{MODEL}", timeout=30).json()


def _wait_ready(app: str) -> None:
    deadline = time.monotonic() + 120
    while httpx.get(f"{app}/ready", timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the app did not become ready"
        time.sleep(1)


def test_weights_set_split_traffic_and_a_session_stays_on_one_version(app):
    serving = _status(app)["live"][0]
    other = "v1" if serving == "v2" else "v2"
    try:
        out = _shunter(app, "weights", "set", MODEL, f"{serving}=50", f"{other}=50")
        assert "50" in out
        _wait_ready(app)
        assert sorted(_status(app)["live"]) == ["v1", "v2"]
        by_session: dict[str, set[str]] = {}
        for n in range(16):
            for _ in range(3):
                resp = httpx.post(f"{app}/v1/chat/completions", timeout=60,
                                  headers={"x-shunter-session": f"session-{n}"},
                                  json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
                assert resp.status_code == 200, resp.text
                by_session.setdefault(f"session-{n}", set()).add(resp.headers["x-shunter-version"])
        assert all(len(v) == 1 for v in by_session.values()), f"a session moved between versions: {by_session}"
        assert set().union(*by_session.values()) == {"v1", "v2"}, "16 sessions on a 50/50 split used one version"
    finally:
        _shunter(app, "weights", "set", MODEL, f"{serving}=100", f"{other}=0")
    assert _status(app)["live"] == [serving]


def test_a_rollout_is_paused_resumed_and_rolled_back_from_the_cli(app):
    serving = _status(app)["live"][0]
    other = "v1" if serving == "v2" else "v2"
    started = httpx.post(f"{app}/admin/rollouts/{MODEL}", timeout=30,
                         json={"to": other, "steps": [10, 100], "hold_s": 600, "max_hold_s": 600})
    assert started.status_code == 202, started.text
    try:
        again = httpx.post(f"{app}/admin/rollouts/{MODEL}", json={"to": other}, timeout=30)
        assert again.status_code == 409 and again.json()["error"]["code"] == "rollout_refused", again.text
        split = httpx.put(f"{app}/admin/models/{MODEL}/weights", json={"weights": {serving: 100}}, timeout=30)
        assert split.status_code == 409, "weights are not set under a rollout in progress"
        replica = httpx.get(f"{app}/admin/models/{MODEL}/replicas", timeout=30).json()["replicas"][0]["replica"]
        drain = httpx.post(f"{app}/admin/models/{MODEL}/replicas/{replica}/drain", json={}, timeout=30)
        assert drain.status_code == 409 and drain.json()["error"]["code"] == "rollout_in_progress", drain.text
        _shunter(app, "rollout", "pause", MODEL)
        assert _status(app)["rollout"]["paused_at"], "paused"
        _shunter(app, "rollout", "resume", MODEL)
        assert not _status(app)["rollout"].get("paused_at"), "resumed"
        out = _shunter(app, "rollout", "rollback", MODEL)
        assert "rolling_back" in out or "rolled_back" in out, out
        status = wait_done(app, MODEL)
        assert status["rollout"]["outcome"] == "rolled_back" and status["live"] == [serving]
    finally:
        if _status(app)["rollout"]["phase"] != "done":
            httpx.post(f"{app}/admin/rollouts/{MODEL}/rollback", timeout=30)
            wait_done(app, MODEL)


def test_the_last_routable_replica_drains_only_with_force_and_is_replaced_while_serving(app):
    serving = _status(app)["live"][0]
    listed = httpx.get(f"{app}/admin/models/{MODEL}/replicas", timeout=30).json()["replicas"]
    (replica,) = [r["replica"] for r in listed if r["version"] == serving]
    refused = httpx.post(f"{app}/admin/models/{MODEL}/replicas/{replica}/drain", json={}, timeout=30)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "last_replica", refused.text
    forced = httpx.post(f"{app}/admin/models/{MODEL}/replicas/{replica}/drain", json={"force": True}, timeout=30)
    assert forced.status_code == 202 and forced.json()["replace"] is True, forced.text
    deadline, statuses = time.monotonic() + 120, []
    while True:  # the cordoned replica serves until Ray Serve has replaced it: nothing is refused
        resp = httpx.post(f"{app}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "still there"}]})
        statuses.append(resp.status_code)
        now = [r["replica"] for r in httpx.get(f"{app}/admin/models/{MODEL}/replicas", timeout=30).json()["replicas"]
               if r["version"] == serving]
        if now and replica not in now:
            break
        assert time.monotonic() < deadline, f"{replica} was never replaced: {now}"
        time.sleep(0.5)
    assert set(statuses) == {200}, statuses
    _wait_ready(app)
