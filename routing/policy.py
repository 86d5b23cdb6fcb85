"""Replica ranking: pure functions of the candidates' load and cached prefix (no Ray, no clock).

The prefix-aware trade-off is a cost model of delay, counted in prompt tokens to prefill (the engine's
dominant work on a cache miss). Sending a request to replica r costs

    pending(r)                      prefill queued on r ahead of it (sent there, no first byte back yet)
  + uncached(r) x (1 + load(r))     its own prefill, which also delays each request already on r
  + load_cost_tokens x load(r)      decode steps it shares with the requests in flight there
  + adapter_load_tokens x (1 + load(r))   only if it asks for a LoRA adapter r's engine does not hold:
                                    loading it stalls the engine's steps, so everyone on r waits for it
  + adapter_busy_tokens x waits(r)  with LoRA adapters: r's engine mixes at most max_loras adapters in a
                                    batch, so a request for one more waits its turn (1 + adapters held
                                    back there already), and one for a running adapter keeps the
                                    held-back adapters waiting (one turn each)

A decoding request slows a newcomer by little; a queued cold prefill delays it by the whole prefill; and
a cold prefill sent to a busy replica delays everyone there. Counting the last term is what keeps a
warm request from spilling into a cold prefill just because its replica has a prefill queued: under
load, a cache miss costs the whole replica, not only the request. The cheapest replica wins, so:

- a cache miss everywhere goes where the least prefill is queued and the fewest requests wait (not to
  the replica with the smallest cache);
- a cached prefix keeps its replica while the queue there costs less than a cold prefill elsewhere;
- a hot prefix spills once its replica runs far enough ahead, and the spill-over replica then caches
  the prefix too;
- an adapter's requests stay where it is loaded while loading it elsewhere costs more than the queue
  there, and a burst for one adapter spreads (the second replica then holds it too);
- a request for an adapter avoids a replica whose adapter slots other adapters' requests hold, while a
  replica with a free slot can take it, and it does not starve adapters held back where its own runs;
- `max_load_gap` bounds the imbalance outright: a replica carrying more than that many requests beyond
  the least loaded one is only ranked after every replica within the gap.

Ties go to the less loaded replica, then at random, so equal replicas share work evenly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from shunter.routing.prefix import PrefixKey

PREFIX_HIT = "prefix_hit"  # the chosen replica holds the longest cached prefix of any candidate
LOAD_FALLBACK = "load_fallback"  # some replica held more of the prefix, load sent the request elsewhere
LEAST_LOADED = "least_loaded"  # no candidate held any of the prefix: the least loaded one took it


@dataclass(frozen=True)
class Candidate:
    replica: str
    load: int  # requests in flight on the replica
    matched: int = 0  # leading prefix chunks the replica is believed to hold
    pending: int = 0  # prompt tokens sent to the replica and not yet prefilled (no first byte back yet)
    has_adapter: bool = True  # the replica's engine holds the request's LoRA adapter (or it names none)
    adapter_waits: int = 0  # turns waited for an adapter slot, or made others wait (DeploymentRouting.adapter_waits)


@dataclass(frozen=True)
class Ranking:
    order: tuple[str, ...]  # replica ids, best first
    reason: str
    matched_fraction: float  # share of the request's prompt the chosen replica holds


def rank_least_connections(candidates: list[Candidate], rng: random.Random) -> Ranking:
    if not candidates:
        return Ranking((), LEAST_LOADED, 0.0)
    order = sorted(candidates, key=lambda c: (c.load, rng.random()))
    return Ranking(tuple(c.replica for c in order), LEAST_LOADED, 0.0)


def rank_prefix_aware(
    candidates: list[Candidate],
    key: PrefixKey,
    load_cost_tokens: int,
    max_load_gap: int,
    rng: random.Random,
    adapter_load_tokens: int = 0,
    adapter_busy_tokens: int = 0,
) -> Ranking:
    if not candidates:
        return Ranking((), LEAST_LOADED, 0.0)
    least = min(c.load for c in candidates)
    within = [c for c in candidates if c.load - least <= max_load_gap]
    beyond = [c for c in candidates if c.load - least > max_load_gap]

    def cost(c: Candidate) -> tuple[int, int, float]:
        missing = key.uncached_tokens(c.matched) + (0 if c.has_adapter else adapter_load_tokens)
        waiting = adapter_busy_tokens * c.adapter_waits
        return c.pending + missing * (1 + c.load) + load_cost_tokens * c.load + waiting, c.load, rng.random()

    order = sorted(within, key=cost) + sorted(beyond, key=lambda c: (c.load, rng.random()))
    best, most = order[0], max(c.matched for c in candidates)
    if most == 0:
        reason = LEAST_LOADED
    elif best.matched == most:
        reason = PREFIX_HIT
    else:
        reason = LOAD_FALLBACK
    fraction = min(1.0, best.matched * key.chunk_chars / key.chars) if key.chars else 0.0
    return Ranking(tuple(c.replica for c in order), reason, fraction)
