"""Warm standby replicas with real engines (shunter.ops.standby): a model at zero keeps one engine warm and
routed nothing; the first request goes to it at once (no engine start), the policy then names it serving
and Serve starts another standby behind it; the serving replica killed outright, the standby takes the
next request at once, and nothing is lost.

One app, one model: SmolLM2, min_replicas 0, max_replicas 1, standby_replicas 1, a core per replica (2
cores: the serving replica and the standby). How long each step took is printed, not asserted.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.local_app import local_app

from .live import CAPITAL_QUESTION, LiveApp, assert_capital

pytestmark = pytest.mark.own_app
APP, MODEL = "standby", "smol"
HEADER = "x-shunter-replica"
START_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def app() -> Iterator[LiveApp]:
    args = {"models": [
        {"name": MODEL, "source": "builtin:smollm2-135m-instruct", "cpu_cores_per_replica": 1,
         "standby_replicas": 1,
         "autoscaling": {"min_replicas": 0, "max_replicas": 1, "upscale_delay_s": 0, "downscale_delay_s": 600},
         "engine": {"max_model_len": 1024, "max_num_seqs": 8, "cpu_kv_cache_gib": 1}},
    ]}
    with local_app(args, APP, keep_cluster=True) as base:
        yield LiveApp(base_url=base)


def _replicas(live: LiveApp) -> dict[str, bool]:
    """replica -> whether it stands by, as a gateway routes (the admin API)."""
    resp = httpx.get(f"{live.base_url}/admin/models/{MODEL}/replicas", timeout=30)
    assert resp.status_code == 200, resp.text
    return {row["replica"]: row["standby"] for row in resp.json()["replicas"]}


def _wait_for(live: LiveApp, wanted: Any, what: str, timeout_s: float = START_TIMEOUT_S) -> dict[str, bool]:
    deadline = time.monotonic() + timeout_s
    seen: dict[str, bool] = {}
    while time.monotonic() < deadline:
        seen = _replicas(live)
        if wanted(seen):
            return seen
        time.sleep(0.25)
    raise AssertionError(f"{what}: never seen in {timeout_s}s; last {seen}")


def _ask(live: LiveApp) -> str:
    """The capital question; returns the replica that answered (asserting the answer)."""
    raw = live.openai(timeout=120).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": CAPITAL_QUESTION}], max_tokens=30, temperature=0)
    assert_capital(raw.parse().choices[0].message.content, live.base_url, model=MODEL)
    return raw.headers[HEADER]


def _pid(live: LiveApp, replica: str) -> int:
    """The process of `replica`, a serving one: /ready's probe is routed like a request, so it reaches a
    serving replica, which names its process."""
    entry = httpx.get(f"{live.base_url}/ready", timeout=30).json()["models"][MODEL]
    assert entry["replica"] == replica, f"/ready reached {entry['replica']}, not the serving {replica}"
    return int(entry["pid"])


def test_the_first_request_from_zero_goes_to_the_warm_standby_which_then_serves(app):
    # At zero: one replica, warm and standing by.
    (warm,) = _wait_for(app, lambda seen: len(seen) == 1 and all(seen.values()), "one standby replica")
    started = time.monotonic()
    # A longer stream beside it, so that the load lasts past the replicas' metrics pushes: a 30-token answer
    # can end between two of them on a loaded machine, and a load the policy never saw names nobody
    # serving (a full run once waited 300 s for it).
    load = threading.Thread(target=lambda: app.openai(timeout=120).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to one hundred."}], max_tokens=160,
        temperature=0, extra_body={"ignore_eos": True}))
    load.start()
    assert _ask(app) == warm, "the first request from zero is answered by the standby: no engine start"
    print(f"\nstandby: first answer from zero in {time.monotonic() - started:.2f}s")
    load.join(timeout=120)
    # The policy names it serving, and Serve starts another standby behind it.
    seen = _wait_for(app, lambda seen: len(seen) == 2 and seen.get(warm) is False, "a new standby behind it")
    (new,) = [r for r, standing_by in seen.items() if standing_by]
    print(f"standby: the next standby ({new}) running {time.monotonic() - started:.1f}s after the first request")
    assert {_ask(app) for _ in range(4)} == {warm}, "the new standby is routed nothing while the serving one can"


def test_a_killed_serving_replica_is_replaced_by_the_standby_at_once_without_losing_a_request(app):
    seen = _wait_for(app, lambda seen: len(seen) == 2 and sorted(seen.values()) == [False, True],
                     "one serving replica and one standby")
    (serving,) = [r for r, standing_by in seen.items() if not standing_by]
    (standby,) = [r for r, standing_by in seen.items() if standing_by]
    os.kill(_pid(app, serving), signal.SIGKILL)
    started = time.monotonic()
    answered_by = [_ask(app) for _ in range(3)]  # each answered, none lost (the gateway retries a dead replica)
    print(f"\nstandby: three answers {time.monotonic() - started:.2f}s after the serving replica was killed")
    assert set(answered_by) == {standby}, "the standby serves in the dead replica's place"
    seen = _wait_for(app, lambda seen: len(seen) == 2 and seen.get(standby) is False and serving not in seen,
                     "the standby named serving and a replacement standing by")
    print(f"standby: a replacement standby running {time.monotonic() - started:.1f}s after the kill")
