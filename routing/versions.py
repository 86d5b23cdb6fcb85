"""Which version of a model serves a request, under live traffic weights.

Weights are an ordered list of (version, percent). A request of a conversation (the same `user` field or
session header) maps to a fixed point in [0, 100) by hashing its session key with the model's name;
the version whose cumulative range holds the point serves it. During a rollout the controller puts the
incoming version first, so as its share rises (10 -> 50 -> 100) a conversation only ever moves from the
old version to the new one, at most once, and one that reached the new version stays there; a rollback
(share back to 0) returns every conversation to the old version at once. A request with no session key
gets a random point: it belongs to no conversation.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence


def session_point(model: str, session: str) -> float:
    """A stable point in [0, 100) for one conversation of one model."""
    digest = hashlib.blake2b(f"{model}\x00{session}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 10_000 / 100


def choose_version(model: str, weights: Sequence[tuple[str, float]], session: str | None,
                   rng: random.Random | None = None) -> str:
    """The version for a request; `weights` need not sum to 100 (they are scaled), but one must be > 0."""
    live = [(name, float(w)) for name, w in weights if w > 0]
    if not live:
        raise ValueError(f"model {model!r} has no version with traffic weight above 0")
    total = sum(w for _, w in live)
    point = session_point(model, session) if session else (rng or random).random() * 100
    edge = 0.0
    for name, w in live:
        edge += w * 100 / total
        if point < edge:
            return name
    return live[-1][0]  # rounding at the top edge
