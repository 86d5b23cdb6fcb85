"""Precise prefix routing with two real replicas (tests/e2e/routing_app.py: 32 KV blocks of 128 tokens
each, so a few long answers evict a prompt), checked against the engines' own counts: each reply's usage
says how many prompt tokens its engine found cached (`prompt_tokens_details.cached_tokens`), and the
gateway's `x-shunter-prefix-predicted` header says what the router believed.

- a prompt sent twice goes back to its replica, which the router knows holds it (from the replica's report
  of its engine's KV events), and the engine finds what the router predicted;
- long answers then fill both engines' caches with decode blocks (which a router that predicts from what
  it sent never counts) and the prompt's blocks are evicted: the router stops believing the replica holds
  it, and its prediction for the next request equals what the chosen engine really had; the replica's
  own view says it was sent there (what approximate mode believes) and is no longer held, and a request
  pinned to that replica, bypassing the router, finds its engine without it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from shunter.replica_protocol import ReplicaRequest, ReplyHead, RouteHint

from .routing_app import APP, MODEL

pytestmark = pytest.mark.own_app

HEADER, PREDICTED = "x-shunter-replica", "x-shunter-prefix-predicted"
BLOCK = 128
# About 1,300 tokens: ten KV blocks the engine can cache.
PROMPT = " ".join(f"Clause {i}: the archivist Wren{i} shelves folio {i * 11} in vault {i % 7} at dusk."
                  for i in range(48))
QUESTION = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Which vault?"}]


@pytest.fixture(scope="module")
def app(routing_live_app):
    from ray import serve

    return routing_live_app, serve.get_deployment_handle(f"model-{MODEL}", app_name=APP)


def _ask(live: Any) -> tuple[str, int, int, str]:
    """(replica, predicted cached tokens, the engine's cached tokens, the prediction's source). The router
    predicts a share of the prompt (it counts characters, not tokens): times the prompt's tokens."""
    raw = live.openai().chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    usage = raw.parse().usage
    share, source = raw.headers[PREDICTED].split()
    return raw.headers[HEADER], round(float(share) * usage.prompt_tokens), usage.prompt_tokens_details.cached_tokens, \
        source


def _view(handle: Any, replica: str) -> dict[str, Any]:
    return handle.stats.remote(RouteHint(pin=replica)).result(timeout_s=60)["prefix_view"]


def _pinned_cached_tokens(handle: Any, replica: str) -> int:
    """The prompt sent straight to `replica` (no router): what its engine found cached."""
    request = ReplicaRequest(pin=replica, endpoint="chat",
                             body={"model": MODEL, "messages": QUESTION, "max_tokens": 2, "temperature": 0})
    for item in handle.options(stream=True).handle.remote(request):
        if isinstance(item, ReplyHead):
            return item.body["usage"]["prompt_tokens_details"]["cached_tokens"]
    raise AssertionError("the replica sent no reply head")


def _flood_with_long_answers(live: Any, requests: int = 32, tokens: int = 288) -> None:
    """Decode blocks past what each 32-block engine holds: about 16 answers per engine (its max_num_seqs)
    of 3 blocks each (a short prompt and 288 tokens) want 48, so the prompt's 10 cached blocks are all
    reused even when the requests split unevenly (11 on one engine still want 33). Fewer, longer answers
    (16 x 512) evicted as surely in 512 decode steps; these take under 300 plus the preempted ones'
    recompute, which is cheap (their prompts are a few tokens)."""
    async def run() -> None:
        client = live.async_openai()
        await asyncio.gather(*(client.chat.completions.create(
            model=MODEL, max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": f"Tell story number {i}."}]) for i in range(requests)))

    asyncio.run(run())


def _gateway_routing(replica: str) -> list[tuple[str | None, int] | None]:
    """What each gateway's routing state holds for `replica` of the model: the id of the last report of
    its engine's cache it took, and how many keys it still counts as held because it sent them there
    lately (the speculation window). Read inside the gateway processes (the state lives there, and asking
    through a request would change it), with Ray's way to run a function on a live actor."""
    import ray

    from shunter.routing.state import deployment_key

    def read(_actor: Any, key: str, replica: str) -> tuple[str | None, int] | None:
        from shunter.routing import state

        routing = state._by_deployment.get(key)
        return None if routing is None else (routing._prefix_reports.get(replica), routing.prefix.size(replica))

    prefix = f"SERVE_REPLICA::{APP}#gateway#"
    gateways = [ray.get_actor(a["name"], namespace=a["namespace"])
                for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert gateways, "no gateway replica found"
    key = deployment_key(APP, f"model-{MODEL}")
    return ray.get([gateway.__ray_call__.remote(read, key, replica) for gateway in gateways], timeout=60)


def _wait_for_a_fresh_report(replica: str, timeout_s: float = 120) -> None:
    """Until every gateway has taken a report of `replica`'s engine made after now, and counts nothing as
    held only because it sent it there (that lasts the speculation window past the last prompt sent,
    routing.state.SPECULATION_S): its picture of that engine is then the engine's own report."""
    before = {i: seen[0] for i, seen in enumerate(_gateway_routing(replica)) if seen}
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        seen = _gateway_routing(replica)
        if all(now is not None and now[0] != before.get(i) and now[1] == 0 for i, now in enumerate(seen)):
            return
        time.sleep(0.5)
    raise AssertionError(f"no fresh report of {replica} replaced what the gateways sent it: {before} -> {seen}")


def test_the_router_follows_what_the_engines_really_hold(app):
    live, handle = app
    holder, _, _, _ = _ask(live)
    again, predicted, cached, source = _ask(live)
    assert again == holder and source == "precise", (holder, again, source)
    assert cached >= 8 * BLOCK and abs(predicted - cached) <= 2 * BLOCK, (predicted, cached)
    held_before = _view(handle, holder)["held_keys"]

    _flood_with_long_answers(live)  # 32 x 288 tokens: about 48 blocks of answers per 32-block engine
    # Keys sent within the speculation window count as held whatever a report says: wait until the
    # gateways believe only the engine's report again, one made after the flood.
    _wait_for_a_fresh_report(holder)

    view = _view(handle, holder)
    assert view["exact"] and view["losses"] == 0 and view["linked_keys"] >= held_before, view
    replica, predicted, cached, source = _ask(live)
    assert source == "precise"
    assert abs(predicted - cached) <= 2 * BLOCK, \
        f"the router predicted {predicted} cached tokens on {replica}; its engine had {cached}"
    assert cached < 8 * BLOCK, f"the long answers evicted the prompt on both engines ({replica}: {cached})"
    # The replica that held it was sent it (approximate mode believes it still holds it), but its engine
    # has lost it: a request pinned there, past the router, finds (almost) nothing cached.
    if replica != holder:
        assert _pinned_cached_tokens(handle, holder) < 8 * BLOCK
