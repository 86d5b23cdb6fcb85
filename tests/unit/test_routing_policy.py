"""Replica ranking: least connections, and the prefix-aware cost model of cached prefix against load."""

from __future__ import annotations

import random

import pytest

from shunter.routing.policy import (
    LEAST_LOADED,
    LOAD_FALLBACK,
    PREFIX_HIT,
    Candidate,
    rank_least_connections,
    rank_prefix_aware,
)
from shunter.routing.prefix import CHARS_PER_TOKEN, PrefixIndex, prefix_key

BLOCK = 16
CHUNK = BLOCK * CHARS_PER_TOKEN
KEY = prefix_key("p" * (100 * CHUNK), BLOCK)  # 100 chunks, 1600 tokens
TOKENS = KEY.uncached_tokens(0)


def _rank(candidates, key=KEY, load_cost_tokens=10, max_load_gap=1000, seed=0):
    return rank_prefix_aware(candidates, key, load_cost_tokens, max_load_gap, random.Random(seed))


# ---- least connections ----------------------------------------------------------------------------


def test_least_connections_orders_by_load():
    ranking = rank_least_connections([Candidate("a", 3), Candidate("b", 0), Candidate("c", 1)], random.Random(0))
    assert ranking.order == ("b", "c", "a") and ranking.reason == LEAST_LOADED and ranking.matched_fraction == 0


def test_least_connections_breaks_ties_at_random():
    firsts = {rank_least_connections([Candidate("a", 1), Candidate("b", 1)], random.Random(s)).order[0]
              for s in range(50)}
    assert firsts == {"a", "b"}


def test_no_candidates():
    assert rank_least_connections([], random.Random(0)).order == ()
    assert _rank([]).order == ()


# ---- prefix aware ---------------------------------------------------------------------------------


def test_cache_miss_everywhere_goes_to_the_least_loaded():
    for seed in range(20):
        ranking = _rank([Candidate("a", 2), Candidate("b", 0), Candidate("c", 1)], seed=seed)
        assert ranking.order == ("b", "c", "a")
        assert ranking.reason == LEAST_LOADED and ranking.matched_fraction == 0.0


def test_cached_long_prefix_beats_a_slightly_busier_replica():
    ranking = _rank([Candidate("idle", 0), Candidate("holder", 3, matched=100)])
    assert ranking.order == ("holder", "idle")
    assert ranking.reason == PREFIX_HIT and ranking.matched_fraction == 1.0


def test_longer_partial_prefix_wins_at_equal_load():
    ranking = _rank([Candidate("a", 1, matched=10), Candidate("b", 1, matched=60), Candidate("c", 1)])
    assert ranking.order == ("b", "a", "c") and ranking.reason == PREFIX_HIT
    assert ranking.matched_fraction == pytest.approx(0.6)


def test_load_wins_once_queue_cost_exceeds_the_prefill_saved():
    # holder saves TOKENS uncached tokens; each request in flight costs 10 tokens.
    break_even = TOKENS // 10
    below = _rank([Candidate("idle", 0), Candidate("holder", break_even - 1, matched=100)])
    assert below.order[0] == "holder" and below.reason == PREFIX_HIT
    above = _rank([Candidate("idle", 0), Candidate("holder", break_even + 1, matched=100)])
    assert above.order == ("idle", "holder")
    assert above.reason == LOAD_FALLBACK and above.matched_fraction == 0.0


def test_equal_cost_goes_to_the_less_loaded_replica():
    # holder: one chunk less to prefill (16 tokens) but one request more (16 tokens): same cost
    for seed in range(20):
        ranking = _rank([Candidate("holder", 1, matched=1), Candidate("idle", 0)], load_cost_tokens=16, seed=seed)
        assert ranking.order == ("idle", "holder") and ranking.reason == LOAD_FALLBACK


def test_equal_replicas_share_ties_at_random():
    firsts = {_rank([Candidate("a", 2, matched=50), Candidate("b", 2, matched=50)], seed=s).order[0]
              for s in range(50)}
    assert firsts == {"a", "b"}


def test_max_load_gap_excludes_an_overloaded_holder_however_long_its_prefix():
    candidates = [Candidate("holder", 5, matched=100), Candidate("idle", 0), Candidate("mid", 4)]
    ranking = _rank(candidates, load_cost_tokens=0, max_load_gap=4)
    assert ranking.order == ("idle", "mid", "holder")  # within the gap by cost, then the rest by load
    assert ranking.reason == LOAD_FALLBACK
    at_gap = _rank([Candidate("holder", 4, matched=100), Candidate("idle", 0)], load_cost_tokens=0, max_load_gap=4)
    assert at_gap.order[0] == "holder"  # exactly max_load_gap beyond is still allowed


def test_candidates_beyond_the_gap_are_ranked_by_load():
    ranking = _rank([Candidate("x", 9, matched=100), Candidate("y", 7), Candidate("z", 0)], max_load_gap=2)
    assert ranking.order == ("z", "y", "x")


def test_matched_fraction_counts_whole_chunks_of_the_prompt():
    key = prefix_key("q" * (4 * CHUNK + CHUNK // 2), BLOCK)  # 4.5 chunks: 4 keys
    assert _rank([Candidate("a", 0, matched=2)], key=key).matched_fraction == pytest.approx(2 / 4.5)
    assert _rank([Candidate("a", 0, matched=4)], key=key).matched_fraction == pytest.approx(4 / 4.5)
    empty = prefix_key("", BLOCK)
    ranking = _rank([Candidate("a", 0), Candidate("b", 1)], key=empty)
    assert ranking.order == ("a", "b") and ranking.matched_fraction == 0.0 and ranking.reason == LEAST_LOADED


# ---- a hot prefix ---------------------------------------------------------------------------------


def _route_hot_prefix(requests: int, load_cost_tokens: int, max_load_gap: int, seed: int) -> dict[str, int]:
    """Route `requests` sharing one long prompt to two replicas; loads only grow (nothing completes)."""
    key = prefix_key("s" * (64 * CHUNK), BLOCK)  # 1024 tokens
    index, loads, rng = PrefixIndex(), {"r1": 0, "r2": 0}, random.Random(seed)
    for _ in range(requests):
        candidates = [Candidate(r, loads[r], index.matched(r, key.keys)) for r in loads]
        chosen = rank_prefix_aware(candidates, key, load_cost_tokens, max_load_gap, rng).order[0]
        loads[chosen] += 1
        index.record(chosen, key.keys)
    return loads


@pytest.mark.parametrize("load_cost_tokens, max_load_gap", [(256, 8), (64, 8), (0, 3), (0, 0)])
def test_hot_prefix_spreads_over_both_replicas_within_the_gap(load_cost_tokens, max_load_gap):
    for seed in range(10):
        loads = _route_hot_prefix(20, load_cost_tokens, max_load_gap, seed)
        assert sum(loads.values()) == 20
        assert min(loads.values()) > 0
        # a replica is preferred only while at most max_load_gap ahead, so it ends at most one beyond
        assert max(loads.values()) - min(loads.values()) <= max_load_gap + 1


def test_hot_prefix_stays_put_while_the_cost_model_says_so():
    # 1024 cached tokens against 256 per request in flight: the holder keeps the first four requests.
    loads = _route_hot_prefix(4, load_cost_tokens=256, max_load_gap=8, seed=0)
    assert sorted(loads.values()) == [0, 4]


# ---- pending prefill ------------------------------------------------------------------------------


def test_a_cache_miss_goes_where_the_least_prefill_is_queued():
    ranking = _rank([Candidate("a", 1, 0, pending=1500), Candidate("b", 1, 0, pending=100)])
    assert ranking.order[0] == "b" and ranking.reason == LEAST_LOADED


def test_a_cached_prefix_loses_only_to_an_idle_replica_when_its_queue_outweighs_a_cold_prefill():
    holds_all = len(KEY.keys)
    stays = _rank([Candidate("a", 2, holds_all, pending=TOKENS - 200), Candidate("b", 0, 0, pending=0)])
    assert stays.order[0] == "a" and stays.reason == PREFIX_HIT  # the queue costs less than a cold prefill
    moves = _rank([Candidate("a", 2, holds_all, pending=TOKENS + 200), Candidate("b", 0, 0, pending=0)])
    assert moves.order[0] == "b" and moves.reason == LOAD_FALLBACK


def test_a_cold_prefill_on_a_busy_replica_counts_the_delay_it_causes_there():
    # The same queue ahead, but b has two requests in flight that a cold prefill there would hold up.
    holds_all = len(KEY.keys)
    ranking = _rank([Candidate("a", 2, holds_all, pending=TOKENS + 200), Candidate("b", 2, 0, pending=0)])
    assert ranking.order[0] == "a" and ranking.reason == PREFIX_HIT
