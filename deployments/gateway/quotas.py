"""Per-key quotas: requests and tokens per minute, as token buckets, with OpenAI's rate-limit headers.

Each bucket holds up to one minute's budget and refills continuously, so a key may burst its whole
minute at once and then runs at its rate. A request takes one request token and reserves its tokens
up front: its prompt estimate (characters / 4) plus the completion tokens it may generate (`max_tokens`
times `n` times the prompts of a batch; when it names no `max_tokens`, the default the replica applies). When it ends, it is settled at its real usage (the engine's
`usage`): the difference is given back or charged, and a charge may take the bucket below zero, so a
key that under-declared pays the debt by waiting. Reserving up front stops a burst of large requests
from all passing while the bucket still shows budget; settling afterwards keeps the books exact.

A request that could never fit (its reservation exceeds the whole per-minute budget) is refused at
once with no Retry-After, since waiting would not help.

Buckets live in each gateway replica's memory. With several gateway replicas, each holds its share of
the budget (limit / replicas): Ray's proxies spread requests over them, and a shared store would put a
network hop and a single point of failure in front of every request. Rate-limit headers report the
key's limit and this replica's remaining budget scaled back to the whole key.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CHARS_PER_TOKEN = 4  # the usual estimate for English text with BPE tokenizers
MESSAGE_OVERHEAD_TOKENS = 4  # role markers and separators a chat template adds per message


class TokenBucket:
    """`capacity` tokens, refilled at `per_second`; the level may go below zero (debt) by `charge`."""

    def __init__(self, capacity: float, per_second: float, clock: Callable[[], float] = time.monotonic):
        self.capacity = capacity
        self.per_second = per_second
        self.clock = clock
        self.level = capacity
        self._at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self._at) * self.per_second)
        self._at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` can be taken (0: now)."""
        self._refill()
        return 0.0 if self.level >= amount else (amount - self.level) / self.per_second

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + amount)

    def until_full_s(self) -> float:
        self._refill()
        return (self.capacity - self.level) / self.per_second

    def remaining(self) -> int:
        self._refill()
        return max(0, math.floor(self.level))


@dataclass
class QuotaDecision:
    """The door's answer: admitted (retry_after_s None), or refused with why and when to retry."""

    reserved: int = 0
    retry_after_s: int | None = None
    limit: str | None = None  # requests | tokens
    never_fits: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def admitted(self) -> bool:
        return self.retry_after_s is None and not self.never_fits


class KeyQuota:
    """One key's budgets in this gateway replica. `share`: this replica's part of the key's budget."""

    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None, share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.requests_per_minute, self.tokens_per_minute, self.share = requests_per_minute, tokens_per_minute, share
        self.requests = self._bucket(requests_per_minute, clock)
        self.tokens = self._bucket(tokens_per_minute, clock)

    def _bucket(self, per_minute: int | None, clock: Callable[[], float]) -> TokenBucket | None:
        if per_minute is None:
            return None
        capacity = max(1.0, per_minute * self.share)
        return TokenBucket(capacity, capacity / 60.0, clock)

    def admit(self, reservation: int) -> QuotaDecision:
        """Take one request and reserve `reservation` tokens, or take nothing and say why not."""
        if self.tokens is not None and reservation > self.tokens.capacity:
            return QuotaDecision(limit="tokens", never_fits=True, headers=self.headers())
        waits = {"requests": self.requests.wait_for(1) if self.requests else 0.0,
                 "tokens": self.tokens.wait_for(reservation) if self.tokens else 0.0}
        limit, wait = max(waits.items(), key=lambda kv: kv[1])
        if wait > 0:
            return QuotaDecision(retry_after_s=max(1, math.ceil(wait)), limit=limit, headers=self.headers())
        if self.requests:
            self.requests.take(1)
        if self.tokens:
            self.tokens.take(reservation)
        return QuotaDecision(reserved=reservation, headers=self.headers())

    def settle(self, reserved: int, used: int, request_back: bool = False) -> None:
        """The request is over: it used `used` tokens of the `reserved` it took (`request_back`: it is not
        counted as a request either)."""
        if request_back and self.requests is not None:
            self.requests.give_back(1)
        if self.tokens is None or used == reserved:
            return
        if used < reserved:
            self.tokens.give_back(reserved - used)
        else:
            self.tokens.take(used - reserved)

    def headers(self) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers for the limits this key has."""
        out: dict[str, str] = {}
        for name, bucket, per_minute in (("requests", self.requests, self.requests_per_minute),
                                         ("tokens", self.tokens, self.tokens_per_minute)):
            if bucket is None or per_minute is None:
                continue
            out[f"x-ratelimit-limit-{name}"] = str(per_minute)
            out[f"x-ratelimit-remaining-{name}"] = str(min(per_minute, math.floor(bucket.remaining() / self.share)))
            out[f"x-ratelimit-reset-{name}"] = duration(bucket.until_full_s())
        return out


def duration(seconds: float) -> str:
    """OpenAI's reset format: `250ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A cheap guess of a request's prompt tokens from its text (no tokenizer at the gateway): characters
    / 4 of every text the prompt is made of (message contents as strings or as parts, tool calls, tool
    definitions, documents, every prompt of a batch), token-id lists by their length, plus a few tokens per
    chat message. The replica counts exactly (limits) and the engine's usage settles the quota."""
    total, messages = 0, body.get("messages")
    if isinstance(messages, list):
        total += MESSAGE_OVERHEAD_TOKENS * len(messages) + _text_tokens(messages)
    for key in ("tools", "documents", "functions"):
        if body.get(key):
            total += math.ceil(len(json.dumps(body[key], ensure_ascii=False)) / CHARS_PER_TOKEN)
    for key in ("prompt", "input", "system", "instructions"):  # Messages' system, Responses' instructions
        total += _text_tokens(body.get(key))
    return total


def _text_tokens(value: Any) -> int:
    """Tokens of the text inside `value`: strings anywhere in it (never dict keys), token-id lists by
    length. Walked without recursion (the gateway bounds nesting depth, but not breadth)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += math.ceil(len(item) / CHARS_PER_TOKEN)
        elif isinstance(item, list):
            if item and all(isinstance(v, int) and not isinstance(v, bool) for v in item):
                total += len(item)  # token ids
            else:
                stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return total
