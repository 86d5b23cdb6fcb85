"""LoRA adapters where they are held: the cost model's load term, the routers' picture of which replica
holds which adapter, and the replica's own copy of its engine's adapter LRU (loads counted once, a
broken adapter refused with a 422, new files under a known name never served from the old weights)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from shunter.config.routing import RoutingConfig
from shunter.engine_lora import AdapterUnavailable, EngineAdapters
from shunter.routing.policy import Candidate, rank_prefix_aware
from shunter.routing.prefix import prefix_key
from shunter.routing.state import AdapterResidency, DeploymentRouting

KEY = prefix_key("hello " * 40, 16)  # a short prompt, held nowhere: about 60 tokens to prefill
LOAD_TOKENS = 256  # what loading an adapter costs, in prompt tokens


def _first(candidates, load_cost_tokens=32, seed=0):
    ranking = rank_prefix_aware(candidates, KEY, load_cost_tokens, 1000, random.Random(seed), LOAD_TOKENS)
    return ranking.order[0]


# ---- the cost model ---------------------------------------------------------------------------------


def test_an_adapter_request_goes_to_the_replica_that_holds_the_adapter():
    for seed in range(20):
        assert _first([Candidate("cold", 0, has_adapter=False), Candidate("warm", 0)], seed=seed) == "warm"


def test_the_holder_keeps_it_while_its_queue_costs_less_than_a_load_elsewhere():
    # warm with 2 in flight: 60 x 3 + 32 x 2 = 244; cold and idle: 60 + 256 = 316
    assert _first([Candidate("cold", 0, has_adapter=False), Candidate("warm", 2)]) == "warm"
    # warm with 4 in flight: 60 x 5 + 32 x 4 = 428 > 316: a burst spreads, and cold then holds it too
    assert _first([Candidate("cold", 0, has_adapter=False), Candidate("warm", 4)]) == "cold"


def test_a_request_for_the_base_model_ignores_adapters():
    firsts = {_first([Candidate("a", 0), Candidate("b", 0)], seed=s) for s in range(40)}
    assert firsts == {"a", "b"}


def test_a_load_stalls_everyone_on_the_replica():
    # Neither holds it: the load goes where the fewest requests wait for it.
    for seed in range(10):
        assert _first([Candidate("busy", 3, has_adapter=False), Candidate("idle", 1, has_adapter=False)],
                      seed=seed) == "idle"


def test_a_replica_whose_adapter_slots_are_taken_is_avoided_while_another_has_room():
    # Both hold the adapter; on "full" other adapters hold every slot, so vLLM would hold the request back.
    for seed in range(10):
        ranking = rank_prefix_aware([Candidate("full", 1, adapter_waits=1), Candidate("free", 2)], KEY, 32,
                                    1000, random.Random(seed), LOAD_TOKENS, adapter_busy_tokens=512)
        assert ranking.order[0] == "free"
    # Loading it on an idle replica costs less than waiting out a busy one's adapters.
    ranking = rank_prefix_aware([Candidate("full", 0, adapter_waits=1),
                                 Candidate("cold", 0, has_adapter=False)], KEY, 32, 1000, random.Random(0),
                                LOAD_TOKENS, adapter_busy_tokens=512)
    assert ranking.order[0] == "cold"


# ---- the routers' picture ---------------------------------------------------------------------------


def test_adapter_slots_are_taken_by_the_requests_in_flight_and_on_their_way():
    state = DeploymentRouting("base", "prefix_aware", RoutingConfig(), 16)
    state.sync_replicas(["r1", "r2"], {"r1": {"adapters": [], "adapter_capacity": 4, "adapter_slots": 1},
                                       "r2": {"adapters": [], "adapter_capacity": 4}})
    assert state.adapter_waits("r1", "a") == 0, "an idle engine has a free slot"
    state.dispatched("r1", "q1", 10, adapter="a")
    state.dispatched("r1", "q2", 10)  # the base model takes no slot
    assert (state.adapter_waits("r1", "b"), state.adapter_waits("r1", "a")) == (1, 0)
    assert state.adapter_waits("r2", "b") == 0, "r2 never said how many adapters it mixes"
    state.reserve("q3", "r1", 10, adapter="c")  # chosen for r1 and not yet there: held back behind a
    assert state.adapter_waits("r1", "b") == 2, "behind a, then behind c"
    assert state.adapter_waits("r1", "a") == 1, "one more request for a keeps c waiting"
    state.unreserve("q3")
    state.completed("r1", "q1")
    assert state.adapter_waits("r1", "b") == 0
    state.dispatched("r1", "q4", 10, adapter="c")
    state.forget("r1")
    assert state.adapter_waits("r1", "b") == 0, "a replica that died runs nothing"


def test_what_was_sent_is_held_until_the_replica_evicts_it():
    held = AdapterResidency()
    held.reported("r1", [], 2)
    for adapter in ("a", "b", "c"):
        held.sent("r1", adapter)
    assert not held.holds("r1", "a") and held.holds("r1", "b") and held.holds("r1", "c"), \
        "the least recently used goes past the engine's capacity"
    assert not held.holds("r2", "b"), "nothing was sent to r2"


def test_a_report_is_the_truth_plus_what_was_sent_since():
    held = AdapterResidency()
    held.sent("r1", "x")  # before any report: capacity unknown, kept
    held.reported("r1", ["a", "b"], 3)  # another gateway's adapters; x had not reached the engine yet
    assert [held.holds("r1", n) for n in ("a", "b", "x")] == [True, True, True]
    held.reported("r1", ["b"], 3)  # the engine dropped a and x meanwhile
    assert [held.holds("r1", n) for n in ("a", "b", "x")] == [False, True, False]


def test_a_replica_that_left_holds_nothing():
    held = AdapterResidency()
    held.sent("r1", "a")
    held.retain({"r2"})
    assert not held.holds("r1", "a")


# ---- the replica's copy of its engine's LRU -------------------------------------------------------------


class RecordingEngine:
    """Stands in for vLLM's AsyncLLM's adapter calls (their bookkeeping is what is tested here; the real
    engine loads real adapters in tests/e2e/test_routing_adapters.py)."""

    def __init__(self, failing: set[str] = frozenset()):
        self.added: list[str] = []
        self.removed: list[int] = []
        self.failing = failing

    async def add_lora(self, request) -> bool:
        await asyncio.sleep(0.01)
        if request.lora_name in self.failing:
            raise ValueError("bad safetensors header")
        self.added.append(request.lora_name)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True


def _adapter_dir(root: Path, name: str) -> str:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return str(path)


def _adapters(tmp_path: Path, names, capacity=2, failing=frozenset()):
    counter = itertools.count(1)
    models = SimpleNamespace(lora_requests={}, lora_id_counter=SimpleNamespace(inc=lambda _: next(counter)))
    engine = RecordingEngine(set(failing))
    return EngineAdapters(engine, models, "base", capacity, [(n, _adapter_dir(tmp_path, n)) for n in names]), \
        engine, models


def test_an_adapter_is_loaded_once_and_the_least_recently_used_goes(tmp_path):
    async def run():
        adapters, engine, _ = _adapters(tmp_path, ["a", "b", "c"])
        await adapters.ready("base")  # the base model: nothing to load
        await asyncio.gather(*(adapters.ready("a") for _ in range(5)))  # concurrent firsts: one load
        await adapters.ready("b")
        await adapters.ready("a")
        await adapters.ready("c")  # capacity 2: b, the least recently used, goes
        assert engine.added == ["a", "b", "c"]
        assert adapters.held() == ["a", "c"] and dict(adapters.loads) == {"a": 1, "b": 1, "c": 1}
        await adapters.ready("b")
        assert engine.added[-1] == "b" and adapters.loads["b"] == 2 and adapters.held() == ["c", "b"]
        assert adapters.load_seconds > 0

    asyncio.run(run())


def test_an_adapter_that_cannot_load_is_a_422_and_nothing_is_held(tmp_path):
    async def run():
        adapters, _, _ = _adapters(tmp_path, ["good", "bad"], failing={"bad"})
        with pytest.raises(AdapterUnavailable) as refused:
            await adapters.ready("bad")
        error = refused.value.body["error"]
        assert error["code"] == "adapter_unavailable" and "bad safetensors header" in error["message"]
        assert adapters.held() == [] and not adapters.loads
        (tmp_path / "good" / "adapter_config.json").unlink()
        with pytest.raises(AdapterUnavailable, match="its files are gone"):
            await adapters.ready("good")

    asyncio.run(run())


def test_new_files_under_a_known_name_get_a_new_engine_id(tmp_path):
    async def run():
        adapters, engine, models = _adapters(tmp_path, ["a"])
        await adapters.ready("a")
        old = models.lora_requests["a"].lora_int_id
        assert not adapters.register("a", models.lora_requests["a"].lora_path), "same files: nothing to do"
        assert adapters.register("a", _adapter_dir(tmp_path, "a-v2"))
        for _ in range(1000):  # the old weights are dropped in a task of their own: let it run
            if engine.removed:
                break
            await asyncio.sleep(0.001)
        assert engine.removed == [old] and models.lora_requests["a"].lora_int_id != old
        assert adapters.held() == [], "the old weights are not the adapter any more"
        await adapters.ready("a")
        assert adapters.loads["a"] == 2
        assert adapters.unregister("a") and not adapters.serves("a") and "a" not in models.lora_requests
        assert not adapters.unregister("a")

    asyncio.run(run())
