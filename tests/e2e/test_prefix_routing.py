"""Prefix-aware routing with two real vLLM replicas of SmolLM2, checked by the engines' own counters.

- requests sharing a long prefix land on one replica (the `x-shunter-replica` header says which), and
  that engine's prefix-cache hit counter confirms it held the prefix while the other engine saw none
  of them;
- a burst of concurrent requests on that hot prefix does not pile onto its replica: once that replica
  runs `routing.max_load_gap` requests ahead (or the prefill queued there costs more than prefilling
  elsewhere), the other replica takes some, and caches the prefix too.

This app has its own Ray cluster (two engines of one core each), so it runs after the shared app stops.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from .live import LiveApp, free_port, wait_ready

MODEL = "smol"
HEADER = "x-shunter-replica"
pytestmark = pytest.mark.own_cluster
APP = "prefix-routing"
# About 1,280 tokens (SmolLM2 tokenizer): ten KV blocks of 128 tokens a later request can reuse.
LONG_PREFIX = " ".join(
    f"Rule {i}: the courier named Zephyr{i} delivers parcel batch {i * 7} to depot {i % 13} before noon."
    for i in range(45)
)


@pytest.fixture(scope="module")
def two_replicas(exclusive_machine) -> Iterator[tuple[LiveApp, Any]]:
    import ray
    from ray import serve

    from deployments.app import build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"models": [{
        "name": MODEL, "source": "builtin:smollm2-135m-instruct", "replicas": 2, "cpu_cores_per_replica": 1,
        "engine": {"max_model_len": 2048, "max_num_seqs": 16, "cpu_kv_cache_gib": 1},
    }]}
    serve.run(build_app(args), name=APP, route_prefix="/")
    app = LiveApp(base_url=f"http://127.0.0.1:{port}")
    wait_ready(app.base_url)
    try:
        yield app, serve.get_deployment_handle(f"model-{MODEL}", app_name=APP)
    finally:
        serve.shutdown()
        ray.shutdown()


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
