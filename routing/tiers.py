"""Complexity tiers: which tier (and so which model) a request to `model: auto` goes to, and when a class
of requests must move up a tier because the cheaper tier's answers fall short.

Pure logic, no Ray: the gateway extracts `Features` from the body, `TierRouter` decides, and
`AgreementMonitor` judges the top tier's reference answers against the cheaper tiers' (the gateway
measures the agreement; see deployments/gateway/tiering.py).

The classifier is a handful of regular-expression searches over at most the first `SCAN_CHARS` of the
prompt plus arithmetic: tens of microseconds per request, measured by `shunter bench tiers`. The score
(0 to 1) weighs what makes a request hard for a small model, each capped so that no single signal
decides alone:

    complexity = 0.40 * min(1, prompt tokens / 2000)      long inputs
               + 0.10 * min(1, (user turns - 1) / 8)       long conversations
               + 0.30 * code markers                       code, in or asked for
               + 0.30 * reasoning markers                  prove, derive, step by step, trade-offs, ...
               + 0.20 * math markers                       equations, integrals, arithmetic
               + 0.15 * min(1, max_tokens / 2048)          long answers asked for

A request's class is its dominant trait (code, math, reasoning, long, simple); the monitor judges and
promotes classes, so one kind of request moving up never drags the others with it.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SCAN_CHARS = 20_000  # markers are searched in the first characters of the prompt only: bounded cost
LONG_PROMPT_TOKENS = 2000

_CODE = re.compile(r"```|^\s*(def|class|import|from|#include|public|fn|func|package)\b|\bfunction\s*\(|=>|;\s*$|"
                   r"\b(python|javascript|typescript|sql|rust|golang|c\+\+|java|regex|bash|code|function|bug|"
                   r"compile|stack trace|refactor)\b", re.IGNORECASE | re.MULTILINE)
_REASONING = re.compile(r"\b(step[- ]by[- ]step|prove|proof|derive|derivation|explain why|why (does|do|is|are)|"
                        r"analy[sz]e|analysis|compare|contrast|trade-?offs?|justify|evaluate|critique|design|"
                        r"architecture|plan|strategy|optimi[sz]e|reason(ing)?|implications?|pros and cons)\b",
                        re.IGNORECASE)
_MATH = re.compile(r"\b(integral|derivative|equation|theorem|lemma|probability|matrix|eigen\w*|solve for|"
                   r"calculate|compute)\b|\d\s*[-+*/^=]\s*\d|[∫∑√π]", re.IGNORECASE)


@dataclass(frozen=True)
class Features:
    prompt_tokens: int  # estimated: characters / 4
    turns: int  # user messages (1 for a completion prompt)
    code: bool
    reasoning: bool
    math: bool
    max_tokens: int | None

    @property
    def request_class(self) -> str:
        if self.code:
            return "code"
        if self.math:
            return "math"
        if self.reasoning:
            return "reasoning"
        if self.prompt_tokens >= LONG_PROMPT_TOKENS // 2 or self.turns >= 6:
            return "long"
        return "simple"

    @property
    def complexity(self) -> float:
        score = (0.40 * min(1.0, self.prompt_tokens / LONG_PROMPT_TOKENS)
                 + 0.10 * min(1.0, max(0, self.turns - 1) / 8)
                 + 0.30 * self.code + 0.30 * self.reasoning + 0.20 * self.math
                 + 0.15 * min(1.0, (self.max_tokens or 0) / 2048))
        return round(min(1.0, score), 4)


def features(body: dict[str, Any]) -> Features:
    """The classifier's inputs from a chat, completion, Responses or Messages body (any shape: what is not
    text is skipped)."""
    texts: list[str] = []
    turns = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            if message.get("role") == "user":
                turns += 1
            texts.extend(_texts(message.get("content")))
    for key in ("system", "instructions"):  # Messages' system prompt, Responses' instructions
        texts.extend(_texts(body.get(key)))
    prompt = body.get("prompt", body.get("input"))  # a completion's prompt, a Responses input
    if isinstance(prompt, list) and any(isinstance(item, dict) and item.get("role") == "user" for item in prompt):
        turns = sum(1 for item in prompt if isinstance(item, dict) and item.get("role") == "user")
        for item in prompt:
            texts.extend(_texts(item.get("content")) if isinstance(item, dict) else [])
    elif prompt is not None:
        turns = max(turns, 1)
        texts.extend(_texts(prompt))
    chars = sum(len(t) for t in texts)
    scan = "\n".join(texts)[:SCAN_CHARS]
    asked = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
    max_tokens = asked if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0 else None
    return Features(prompt_tokens=math.ceil(chars / 4), turns=turns, code=bool(_CODE.search(scan)),
                    reasoning=bool(_REASONING.search(scan)), math=bool(_MATH.search(scan)), max_tokens=max_tokens)


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        out: list[str] = []
        for part in value:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
        return out
    return []


@dataclass(frozen=True)
class Tier:
    name: str
    model: str  # the served model's canonical name
    max_complexity: float
    cost_per_1k_prompt: float = 0.0
    cost_per_1k_completion: float = 0.0

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return prompt_tokens / 1000 * self.cost_per_1k_prompt + completion_tokens / 1000 * self.cost_per_1k_completion


@dataclass(frozen=True)
class Decision:
    """Where one request goes, and why (for the response header and the trace)."""

    level: int
    tier: Tier
    request_class: str
    complexity: float
    reason: str  # complexity | promoted | hint | allowed

    def explain(self) -> str:
        return f"class={self.request_class}; complexity={self.complexity:g}; reason={self.reason}; model={self.tier.model}"


class NoTierAllowed(Exception):
    """The caller may use none of the tiers' models."""


class TierRouter:
    """Chooses a tier from a request's features, the client's hint, the classes' promotions and what
    the caller may use."""

    def __init__(self, tiers: Sequence[Tier]):
        if len(tiers) < 2:
            raise ValueError("tier routing needs at least two tiers")
        self.tiers = list(tiers)
        self.floors: dict[str, int] = {}  # class -> the lowest tier it may use (promotions)

    @property
    def top(self) -> int:
        return len(self.tiers) - 1

    def level_of(self, name: str) -> int | None:
        return next((i for i, t in enumerate(self.tiers) if t.name == name), None)

    def choose(self, found: Features, hint: str | None = None,
               allowed: Callable[[str], bool] = lambda model: True) -> Decision:
        klass, complexity = found.request_class, found.complexity
        level = next(i for i, t in enumerate(self.tiers) if complexity <= t.max_complexity or i == self.top)
        reason = "complexity"
        if self.floors.get(klass, 0) > level:
            level, reason = self.floors[klass], "promoted"
        hinted = self.level_of(hint) if hint else None
        if hinted is not None:
            level, reason = hinted, "hint"
        if not allowed(self.tiers[level].model):
            # The caller's key may not use this tier: the nearest tier above it that it may use, else below.
            above = [i for i in range(level + 1, len(self.tiers)) if allowed(self.tiers[i].model)]
            below = [i for i in range(level - 1, -1, -1) if allowed(self.tiers[i].model)]
            if not above and not below:
                raise NoTierAllowed()
            level, reason = (above or below)[0], "allowed"
        return Decision(level, self.tiers[level], klass, complexity, reason)

    def promote(self, klass: str, to_level: int) -> None:
        self.floors[klass] = max(self.floors.get(klass, 0), min(to_level, self.top))


@dataclass(frozen=True)
class Promotion:
    request_class: str
    from_level: int
    to_level: int
    agreement: float  # the mean over the window that fell short
    samples: int


class AgreementMonitor:
    """Agreement samples (0 to 1) per class and tier over a sliding window. A class whose mean on a tier
    below the top falls under the threshold, once it has enough samples, is promoted one tier up; its
    samples on that tier are then dropped (they judged the tier it left)."""

    def __init__(self, threshold: float, min_samples: int, window_s: float, top_level: int,
                 clock: Callable[[], float] = time.monotonic):
        self.threshold, self.min_samples, self.window_s, self.top_level = threshold, min_samples, window_s, top_level
        self.clock = clock
        self._samples: dict[tuple[str, int], deque[tuple[float, float]]] = {}

    def record(self, klass: str, level: int, agreement: float) -> Promotion | None:
        if level >= self.top_level:
            return None  # the top tier is the reference: nothing to compare it with
        now = self.clock()
        window = self._samples.setdefault((klass, level), deque())
        window.append((now, agreement))
        while window and window[0][0] < now - self.window_s:
            window.popleft()
        if len(window) < self.min_samples:
            return None
        mean = sum(score for _, score in window) / len(window)
        if mean >= self.threshold:
            return None
        count = len(window)
        window.clear()
        return Promotion(klass, level, level + 1, round(mean, 4), count)

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per `class@level`: samples in the window and their mean agreement."""
        now = self.clock()
        out = {}
        for (klass, level), window in self._samples.items():
            scores = [s for t, s in window if t >= now - self.window_s]
            if scores:
                out[f"{klass}@{level}"] = {"samples": len(scores), "mean_agreement": round(sum(scores) / len(scores), 4)}
        return out


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity, 0 for a zero vector."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
