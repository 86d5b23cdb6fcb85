"""Version choice under traffic weights: shares, stickiness while weights move, rollback."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from shunter.routing.versions import choose_version, session_point

SESSIONS = [f"user-{i}" for i in range(2000)]


def test_shares_follow_the_weights():
    rng = random.Random(7)
    counts = Counter(choose_version("m", [("v2", 10), ("v1", 90)], None, rng) for _ in range(10_000))
    assert 800 < counts["v2"] < 1200
    assert Counter(choose_version("m", [("v2", 50), ("v1", 50)], s) for s in SESSIONS)["v2"] in range(900, 1100)


def test_a_conversation_moves_at_most_once_and_never_back_while_the_new_share_rises():
    history: dict[str, list[str]] = {s: [] for s in SESSIONS}
    for share in (0, 10, 50, 100):
        for s in SESSIONS:
            history[s].append(choose_version("m", [("v2", share), ("v1", 100 - share)], s))
    for s, seen in history.items():
        assert seen == sorted(seen), f"{s} went back to v1: {seen}"  # v1 ... v1, then v2 ... v2


def test_the_same_conversation_gets_the_same_version_every_time():
    picks = {choose_version("m", [("v2", 30), ("v1", 70)], "alice") for _ in range(50)}
    assert len(picks) == 1


def test_rollback_returns_everyone_to_the_old_version():
    assert {choose_version("m", [("v2", 0), ("v1", 100)], s) for s in SESSIONS} == {"v1"}


def test_points_differ_per_model_and_stay_in_range():
    assert session_point("a", "alice") != session_point("b", "alice")
    assert all(0 <= session_point("m", s) < 100 for s in SESSIONS)


def test_no_live_version_is_an_error():
    with pytest.raises(ValueError, match="no version"):
        choose_version("m", [("v1", 0)], "x")
