"""Prefix-aware routing with two real vLLM replicas of SmolLM2, checked by the engines' own counters.

- requests sharing a long prefix land on one replica (the `x-shunter-replica` header says which), and
  that engine's prefix-cache hit counter confirms it held the prefix while the other engine saw none
  of them;
- a burst of concurrent requests on that hot prefix does not pile onto its replica: once that replica
  runs `routing.max_load_gap` requests ahead (or the prefill queued there costs more than prefilling
  elsewhere), the other replica takes some, and caches the prefix too;
- an operator drains a replica through the admin API: cordoned, it gets no new request (released, it
  gets them again); the last routable replica is not drained without `force`; `shunter replicas drain`
  cordons it for replacement (Ray Serve's replacing it once idle is shown with fake engines, which start
  in seconds: tests/integration/test_rollouts.py).

The app (tests/e2e/routing_app.py, two engines of one core each, with keys and LoRA adapters) is shared
with tests/e2e/test_routing_adapters.py and test_routing_precise.py; these requests name the base model
only.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .live import LiveApp
from .routing_app import ADMIN, APP, MODEL

HEADER = "x-shunter-replica"
pytestmark = pytest.mark.own_app
# About 1,280 tokens (SmolLM2 tokenizer): ten KV blocks of 128 tokens a later request can reuse.
LONG_PREFIX = " ".join(
    f"Rule {i}: the courier named Zephyr{i} delivers parcel batch {i * 7} to depot {i % 13} before noon."
    for i in range(45)
)


@pytest.fixture(scope="module")
def two_replicas(routing_live_app) -> Iterator[tuple[LiveApp, Any]]:
    from ray import serve

    yield routing_live_app, serve.get_deployment_handle(f"model-{MODEL}", app_name=APP)


def _ask(client: Any, system: str, question: str) -> str:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=2, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    assert raw.parse().choices[0].message is not None
    return raw.headers[HEADER]


def _counters(handle: Any, replica: str) -> dict[str, Any]:
    from shunter.replica_protocol import RouteHint

    stats = handle.stats.remote(RouteHint(pin=replica)).result(timeout_s=60)
    assert stats["replica"] == replica, "a pinned call reaches exactly its replica"
    return stats


def _replica_ids(client: Any) -> list[str]:
    seen: set[str] = set()
    for i in range(40):  # short prompts hold no prefix: the idle replicas share them at random
        seen.add(_ask(client, "Be brief.", f"Say {i}."))
        if len(seen) == 2:
            return sorted(seen)
    raise AssertionError("the two idle replicas should both get short requests")


def test_shared_prefix_requests_land_on_the_replica_that_caches_it(two_replicas):
    app, handle = two_replicas
    client = app.openai()
    replicas = _replica_ids(client)
    before = {r: _counters(handle, r) for r in replicas}

    served = [_ask(client, LONG_PREFIX, f"Which depot gets batch {7 * q}?") for q in range(6)]
    assert len(set(served)) == 1, f"one replica should serve a shared prefix, got {served}"
    holder = served[0]
    (other,) = [r for r in replicas if r != holder]

    after = {r: _counters(handle, r) for r in replicas}
    queries = after[holder]["prefix_cache_queries"] - before[holder]["prefix_cache_queries"]
    hits = after[holder]["prefix_cache_hits"] - before[holder]["prefix_cache_hits"]
    # Five of the six requests find about 1,200 of their ~1,330 prompt tokens cached.
    assert queries > 6 * 1000 and hits > 5 * 1000, (queries, hits)
    assert hits / queries > 0.7, f"the engine's own counters should show the prefix reused ({hits}/{queries})"
    assert after[other]["prefix_cache_queries"] == before[other]["prefix_cache_queries"], \
        "the other replica saw none of these requests"


def test_a_hot_prefix_spreads_when_its_replica_queues_up(two_replicas):
    app, handle = two_replicas
    client = app.async_openai()

    async def burst() -> list[str]:
        async def one(q: int) -> str:
            raw = await client.chat.completions.with_raw_response.create(
                # Long enough answers that the burst overlaps on the holder however slowly it arrives.
                model=MODEL, max_tokens=48, temperature=0,
                messages=[{"role": "system", "content": LONG_PREFIX},
                          {"role": "user", "content": f"Who delivers batch {7 * q}?"}])
            return raw.headers[HEADER]

        return await asyncio.gather(*(one(q) for q in range(16)))

    served = Counter(asyncio.run(burst()))
    assert len(served) == 2, f"a burst on one hot prefix must not pile onto one replica: {served}"
    most = max(served.values())
    assert most >= 9, f"the replica that caches the prefix should still take the larger share: {served}"


ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


def _replicas(app: LiveApp) -> list[dict[str, Any]]:
    resp = httpx.get(f"{app.base_url}/admin/models/{MODEL}/replicas", headers=ADMIN_HEADERS, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["replicas"]


def _cli(app: LiveApp, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "shunter.cli", *args, "--url", app.base_url], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "SHUNTER_ADMIN_KEY": ADMIN})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _drain(app: LiveApp, replica: str, method: str = "POST", **body: Any) -> httpx.Response:
    return httpx.request(method, f"{app.base_url}/admin/models/{MODEL}/replicas/{replica}/drain",
                         json=body if method != "DELETE" else None, headers=ADMIN_HEADERS, timeout=60)


def test_an_operator_drains_a_replica_with_the_api_and_the_cli(two_replicas):
    app, _ = two_replicas
    client = app.openai()
    listed = _replicas(app)
    assert [r["cordoned"] for r in listed] == [False, False], listed
    drained, kept = (r["replica"] for r in listed)

    assert _drain(app, "no-such-replica").json()["error"]["code"] == "replica_not_found"
    resp = _drain(app, drained, replace=False)
    assert resp.status_code == 202 and resp.json()["cordoned"] and not resp.json()["replace"], resp.text
    assert {_ask(client, "Be brief.", f"Say {i}.") for i in range(8)} == {kept}, "a cordoned replica gets nothing new"
    refused = _drain(app, kept, replace=False)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "last_replica", refused.text

    resp = _drain(app, drained, method="DELETE")
    assert resp.status_code == 200 and not resp.json()["cordoned"], resp.text
    assert drained in {_ask(client, "Be brief.", f"Count to {i}.") for i in range(40)}, "released, it serves again"

    said = _cli(app, "replicas", "drain", MODEL, drained, "--timeout-s", "120")  # the operator's command
    assert f"replica {drained} of {MODEL} (version default) cordoned: Ray Serve replaces it once idle" in said, said
    assert f"{drained}  version default  CORDONED" in _cli(app, "replicas", "list", MODEL)
    assert {_ask(client, "Be brief.", f"Name {i}.") for i in range(6)} == {kept}
    # Ray Serve then replaces the drained replica once it is idle (its health check fails): shown with fake
    # engines in tests/integration/test_rollouts.py, where a replica starts in
    # seconds; here a new engine would add half a minute. The app is stopped after this module.
