"""The prefix-cache hit rate of a router that knows every replica's KV cache: the ceiling a routing policy's
engine hit rate is measured against (`shunter bench routing`).

The oracle replays the exact prompts a run sent, in the order they were sent, tokenized as the engine
tokenizes them (the model's own tokenizer and chat template), over N simulated replicas. Each replica holds
an LRU cache of whole KV blocks (`block_size` tokens, 128 on vLLM's CPU build) of the engines' real
capacity. The semantics are vLLM's prefix caching:

- a prompt's blocks are chained: block i is the same cached block only if the whole prompt up to and
  including it is the same (a key is (the previous block's key, this block's tokens));
- only full blocks are cached; a hit is the leading run of the prompt's blocks the replica holds, and at
  most prompt_len - 1 tokens (vLLM always computes the last prompt token);
- after a request, all its full prompt blocks are held, most recently used; eviction takes the least
  recently used block, and within one request its tail blocks before its head blocks (vLLM frees a request's
  blocks tail first into its free queue).

Routing: each request goes to the replica holding the most of its leading blocks, among the replicas that
were sent at most `max_load_gap` more requests than the least used one (a count of requests sent, a plain
balance proxy; the default is `routing.max_load_gap`'s); ties go to the less used replica, then the lower
index. Hit rate = hit tokens / prompt tokens, over the requests that reached an engine (HTTP 200).

What it ignores, and why it is still the ceiling the goals refer to:
- timing and concurrency: requests are handled one after another, each seeing every earlier request's
  blocks already cached, where a real engine misses a prefix another request is still prefilling;
- space taken by work in flight: running requests pin their blocks and decoding fills more (decode blocks
  are neither cached nor counted here), so a real cache of the same size holds fewer prompt blocks;
- preemption, and the null block (the capacity used is `kv_cache_blocks` - 1, what vLLM can hand out).
Every one of these can only lower what a real replica finds cached, so no router, however precise its
view of the engines, gets a higher hit rate on these prompts under the same balance rule. (It is a
greedy router with perfect knowledge, not an optimal planner: one that knew the future could sometimes
place a prefix better; the goal is to match perfect knowledge, not foresight.)

`PromptRecorder` keeps the request bodies the load generator sends (the run's result keeps only each
request's measurements, and a multi-turn prompt holds the server's real answers, so the prompts cannot be
rebuilt from the seeded workload alone).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

BLOCK_SIZE = 128  # vLLM's KV block on the CPU build


def default_max_load_gap() -> int:
    from shunter.config.routing import RoutingConfig

    return int(RoutingConfig.model_fields["max_load_gap"].default)


class BlockKeys:
    """Chained keys of a prompt's full blocks: the same key only for the same tokens after the same
    prefix. Keys are small ints handed out by an exact table (no hash collisions)."""

    def __init__(self, block_size: int = BLOCK_SIZE):
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def __call__(self, tokens: Sequence[int]) -> list[int]:
        keys, parent = [], -1
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = self._ids.setdefault((parent, tuple(tokens[start:start + self.block_size])), len(self._ids))
            keys.append(parent)
        return keys

    def __len__(self) -> int:
        """Distinct blocks seen so far."""
        return len(self._ids)


class LRUBlockCache:
    """One replica's cached blocks, least recently used first."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("a replica's cache holds at least one block")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def leading_hits(self, keys: Sequence[int]) -> int:
        """How many of `keys`, from the first on, the cache holds (a chain: the first miss ends it)."""
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            n += 1
        return n

    def admit(self, keys: Sequence[int]) -> None:
        """A request's blocks are now held, most recently used; its head outlives its tail."""
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)
            else:
                self._blocks[key] = None
                while len(self._blocks) > self.capacity:
                    self._blocks.popitem(last=False)

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)


@dataclass
class OracleResult:
    replicas: int
    capacity_blocks: int  # per replica
    block_size: int
    max_load_gap: int
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    distinct_blocks: int = 0  # distinct full prompt blocks of the whole run
    requests_per_replica: list[int] = field(default_factory=list)
    choices: list[int] = field(default_factory=list)  # the replica of each request, in order

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def distinct_over_capacity(self) -> float:
        """Distinct prompt blocks over one replica's capacity (>= 2: under pressure)."""
        return self.distinct_blocks / self.capacity_blocks

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("choices")
        return {**out, "hit_rate": self.hit_rate, "distinct_over_capacity": self.distinct_over_capacity}


def simulate(prompts: Iterable[Sequence[int]], replicas: int, capacity_blocks: int, block_size: int = BLOCK_SIZE,
             max_load_gap: int | None = None) -> OracleResult:
    """Route and cache `prompts` (token ids, in send order) as a router that sees every cache would."""
    if replicas < 1:
        raise ValueError("at least one replica")
    gap = default_max_load_gap() if max_load_gap is None else max_load_gap
    caches = [LRUBlockCache(capacity_blocks) for _ in range(replicas)]
    sent = [0] * replicas
    keys_of = BlockKeys(block_size)
    result = OracleResult(replicas, capacity_blocks, block_size, gap)
    for tokens in prompts:
        keys = keys_of(tokens)
        usable = max(0, (len(tokens) - 1) // block_size)  # a hit leaves at least the last token to compute
        least = min(sent)
        hits = {r: min(usable, caches[r].leading_hits(keys)) for r in range(replicas) if sent[r] - least <= gap}
        choice = max(hits, key=lambda r: (hits[r], -sent[r], -r))
        caches[choice].admit(keys)
        sent[choice] += 1
        result.requests += 1
        result.prompt_tokens += len(tokens)
        result.hit_tokens += hits[choice] * block_size
        result.choices.append(choice)
    result.distinct_blocks = len(keys_of)
    result.requests_per_replica = sent
    return result


def prompt_token_ids(bodies: Iterable[dict[str, Any]], tokenizer: Any) -> list[list[int]]:
    """The token ids an engine sees for each request body: a chat request through the model's chat
    template (with the generation prompt, as vLLM renders it), a completion's prompt as it is."""
    out = []
    for body in bodies:
        if "messages" in body:
            text = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            out.append(list(tokenizer.encode(text, add_special_tokens=False)))
        elif isinstance(body.get("prompt"), str):
            out.append(list(tokenizer.encode(body["prompt"])))
        else:
            raise ValueError("the oracle reads chat and completions requests only")
    return out


class PromptRecorder:
    """The request bodies a run sends, by request index: pass it as `on_send` to the run
    (`shunter.bench.runner.run`), then `in_order()` gives them in the order of the run's records."""

    def __init__(self) -> None:
        self._bodies: dict[int, dict[str, Any]] = {}
        self.first_sent_at: float | None = None  # time.perf_counter() of the first request: the run's clock

    def __call__(self, index: int, body: dict[str, Any]) -> None:
        if self.first_sent_at is None:
            self.first_sent_at = time.perf_counter()
        self._bodies[index] = body

    def in_order(self) -> list[dict[str, Any]]:
        return [self._bodies[i] for i in sorted(self._bodies)]


def oracle_for_run(bodies: list[dict[str, Any]], requests: list[dict[str, Any]], tokenizer: Any, replicas: int,
                   kv_cache_blocks: int, block_size: int = BLOCK_SIZE,
                   max_load_gap: int | None = None) -> dict[str, Any]:
    """The oracle over one run: `bodies` from a `PromptRecorder`, `requests` the run's records (JSON), the
    replicas' reported `kv_cache_blocks` (one of them is vLLM's null block). Also compares each prompt's
    token count with what the server reported, a check that the oracle tokenizes as the engine does."""
    if len(bodies) != len(requests):
        raise ValueError(f"{len(bodies)} bodies recorded for {len(requests)} requests")
    served = [(body, record) for body, record in zip(bodies, sorted(requests, key=lambda r: r["index"]), strict=True)
              if record.get("status") == 200]  # the engine saw it (a refused request never reached one)
    tokens = prompt_token_ids([body for body, _ in served], tokenizer)
    result = simulate(tokens, replicas, max(1, kv_cache_blocks - 1), block_size, max_load_gap)
    reported = [(len(t), record["prompt_tokens"]) for t, (_, record) in zip(tokens, served, strict=True)
                if record.get("ok")]
    off = [abs(mine - theirs) for mine, theirs in reported if mine != theirs]
    return {**result.to_json(), "token_count_mismatches": len(off), "token_count_checked": len(reported),
            "token_count_max_diff": max(off, default=0)}
