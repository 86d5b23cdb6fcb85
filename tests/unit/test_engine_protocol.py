"""The engine interface a replica calls (shunter.engine_protocol): vLLM's adapter satisfies it as written,
without starting an engine; so does every fake engine a test starts through the replica's `engine_factory`
seam; an engine that lacks a member, or declares it otherwise, is refused by name; and each endpoint's
wire name calls the engine's method of that name."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shunter.config import EngineConfig
from shunter.endpoints import ENDPOINTS
from shunter.engine import EngineCounters, EngineReply, EngineSpec, VLLMEngine
from shunter.engine_protocol import (
    METHODS,
    OPTIONAL,
    OPTIONAL_CALLS,
    BaseEngine,
    ServingEngine,
    engine_problems,
    require_engine,
)

TESTS = Path(__file__).resolve().parents[1]


def _parameters(member: Any) -> list[str]:
    return [name for name in inspect.signature(member).parameters if name != "self"]


def _spec() -> EngineSpec:
    return EngineSpec("m", "/models/m", "generate", EngineConfig(), "cpu")


def test_the_interface_declares_what_the_replica_uses():
    assert set(METHODS) >= {"chat", "completion", "embedding", "responses", "messages", "warmup", "check_health",
                            "shutdown", "max_model_len", "dtype", "num_unfinished_requests", "prompt_lengths",
                            "kv_cache_blocks", "block_size", "process_ids"}
    assert set(OPTIONAL) == {"counters", "adapters", "prefix_view", "progress", "produced", "start_phases"}
    assert set(ENDPOINTS) <= set(METHODS), "every endpoint the platform serves is an engine call"


def test_vllm_engine_has_every_member_with_the_declared_parameters():
    for name in METHODS:
        declared, member = getattr(ServingEngine, name), getattr(VLLMEngine, name, None)
        assert member is not None, f"VLLMEngine lacks {name}"
        assert _parameters(member) == _parameters(declared), name
        assert inspect.iscoroutinefunction(member) == inspect.iscoroutinefunction(declared), name
    for name, parameters in OPTIONAL_CALLS.items():
        assert _parameters(getattr(VLLMEngine, name)) == list(parameters), name
    assert engine_problems(VLLMEngine) == []


def test_an_unstarted_vllm_engine_is_a_serving_engine_with_its_optional_members_set():
    engine = VLLMEngine(_spec(), SimpleNamespace(), SimpleNamespace())  # no vLLM behind it: nothing is called
    assert isinstance(engine, ServingEngine)
    assert require_engine(engine) is engine
    assert engine.adapters is None and engine.prefix_view is None  # no LoRA, no precise prefix routing
    assert isinstance(engine.counters, EngineCounters)
    assert callable(engine.progress) and callable(engine.produced)
    assert engine.start_phases is None, "set by VLLMEngine.start"


def _factory_engines() -> list[type]:
    """Every engine class a test passes as the replica's `engine_factory` ("module:Class.start")."""
    factories = set()
    for path in TESTS.rglob("*.py"):
        factories.update(re.findall(r'"(tests\.[\w.]+:\w+)\.start"', path.read_text()))
    classes = []
    for factory in sorted(factories):
        module, _, name = factory.partition(":")
        classes.append(getattr(importlib.import_module(module), name))
    return classes


def test_every_fake_engine_a_test_injects_is_a_serving_engine():
    engines = _factory_engines()
    assert engines, "the integration tests inject at least the fault engine"
    for cls in engines:
        assert issubclass(cls, BaseEngine), cls
        assert engine_problems(cls) == [], cls
        assert "FAKE" in (inspect.getdoc(cls) or "").upper(), f"{cls.__name__} names itself a fake"
    from tests.integration.fault_engine import FaultInjectingEngine

    engine = FaultInjectingEngine(_spec(), "replica-1")
    assert isinstance(engine, ServingEngine) and require_engine(engine) is engine
    assert engine.adapters is None and engine.dtype() is None
    assert engine.produced is not None, "it counts a stream's tokens where the replica reads them, as vLLM's does"


def test_unit_stand_ins_declare_what_they_write_as_the_interface_does():
    from tests.unit.test_engine_usage import CountingEngine

    problems = engine_problems(CountingEngine())  # a partial engine: only what `_serve` calls is written
    assert len(problems) == 1 and problems[0].startswith("missing "), problems
    missing = problems[0].removeprefix("missing ").split(", ")
    assert {"chat", "progress", "produced", "adapters", "prefix_view"}.isdisjoint(missing), missing


class _Complete(BaseEngine):
    """Every required member, as declared."""

    async def chat(self, body: dict[str, Any]) -> EngineReply:
        return EngineReply(200, {"endpoint": "chat"})

    async def completion(self, body: dict[str, Any]) -> EngineReply:
        return EngineReply(200, {"endpoint": "completion"})

    async def embedding(self, body: dict[str, Any]) -> EngineReply:
        return EngineReply(200, {"endpoint": "embedding"})

    async def responses(self, body: dict[str, Any]) -> EngineReply:
        return EngineReply(200, {"endpoint": "responses"})

    async def messages(self, body: dict[str, Any]) -> EngineReply:
        return EngineReply(200, {"endpoint": "messages"})

    async def warmup(self) -> None:
        return None

    async def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def max_model_len(self) -> int:
        return 128

    def num_unfinished_requests(self) -> int:
        return 0

    async def prompt_lengths(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        return None


def test_the_base_engine_defaults_every_optional_capability_to_none():
    engine = _Complete()
    assert require_engine(engine) is engine and isinstance(engine, ServingEngine)
    assert all(getattr(engine, name) is None for name in OPTIONAL)
    assert (engine.dtype(), engine.kv_cache_blocks(), engine.block_size()) == (None, 0, 0)


def test_an_engine_missing_a_member_is_refused_by_name():
    NoMessages = type("NoMessages", (BaseEngine,),
                      {k: v for k, v in vars(_Complete).items() if k != "messages" and not k.startswith("__")})

    class Partial:  # neither a BaseEngine nor complete
        async def chat(self, body: dict[str, Any]) -> EngineReply:
            return EngineReply(200)

    assert not hasattr(NoMessages(), "messages")
    with pytest.raises(TypeError, match=r"NoMessages is not a .*ServingEngine: missing messages$"):
        require_engine(NoMessages())
    assert not isinstance(NoMessages(), ServingEngine)
    with pytest.raises(TypeError) as refused:
        require_engine(Partial())
    missing = str(refused.value).split("missing ", 1)[1].split(", ")
    assert set(missing) == (set(METHODS) | set(OPTIONAL)) - {"chat"}, missing


def test_an_engine_declaring_a_member_otherwise_is_refused_by_name():
    class Renamed(_Complete):
        async def chat(self, request: dict[str, Any]) -> EngineReply:  # type: ignore[override]
            return EngineReply(200)

        def warmup(self) -> None:  # type: ignore[override]
            return None

        def produced(self) -> tuple[int, int]:  # type: ignore[override]
            return 0, 0

    problems = engine_problems(Renamed())
    assert problems == ["chat(request) takes other parameters than chat(body)", "warmup must be async",
                        "produced() takes other parameters than produced(tally)"], problems
    with pytest.raises(TypeError, match="warmup must be async"):
        require_engine(Renamed())


def test_each_endpoints_descriptor_calls_the_engine_method_of_its_name():
    engine = _Complete()

    async def run() -> dict[str, Any]:
        return {name: (await described.engine_call(engine, {})).body for name, described in ENDPOINTS.items()}

    assert asyncio.run(run()) == {name: {"endpoint": name} for name in ENDPOINTS}
