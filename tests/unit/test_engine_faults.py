"""Whose fault a failure in vLLM's serving layer is (shunter.engine): an exception the engine did not cause
is the request's 400, mid-stream too; the engine's own failures stay the replica's 5xx, the ones its
breakers count. Exceptions are raised from code compiled under vLLM's file names, so the decision is
made from where they arise, as on a replica. No engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from shunter.engine import RequestFault, VLLMEngine, _noting_errors, _serving_errors

pytestmark = pytest.mark.unit

SITE = "/venv/lib/python3.11/site-packages/vllm/"


def raised_in(path: str, exc: type[BaseException] = IndexError) -> BaseException:
    """An exception whose innermost frame is in vLLM's file `path` (under site-packages/vllm/)."""
    scope: dict[str, Any] = {"exc": exc}
    exec(compile("def fail():\n    raise exc('list index out of range')\n", SITE + path, "exec"), scope)
    try:
        scope["fail"]()
    except BaseException as caught:  # noqa: BLE001
        return caught
    raise AssertionError("unreachable")


def engine(errored: bool = False) -> VLLMEngine:
    replica = VLLMEngine.__new__(VLLMEngine)
    replica._engine = SimpleNamespace(errored=errored)
    replica.spec = SimpleNamespace(served_name="m")
    return replica


def test_an_exception_in_the_serving_layer_is_the_requests_fault_named_by_type_and_place():
    fault = engine().request_fault([raised_in("entrypoints/openai/responses/serving.py")])
    assert isinstance(fault, RequestFault) and fault.status == 400
    assert "IndexError" in fault.message and "vllm/entrypoints/openai/responses/serving.py" in fault.message
    assert "/venv/" not in fault.message, "no local path in a client's message"
    assert "list index out of range" not in fault.message, "never the exception's text: it may quote the input"


@pytest.mark.parametrize("exc", [
    raised_in("v1/engine/async_llm.py"),  # raised through the engine client
    raised_in("entrypoints/openai/responses/serving.py", MemoryError),
])
def test_the_engines_own_failures_stay_the_replicas(exc):
    assert engine().request_fault([exc]) is None


def test_a_dead_engine_or_its_own_error_types_are_the_replicas():
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    assert engine(errored=True).request_fault([raised_in("entrypoints/openai/responses/serving.py")]) is None
    assert engine().request_fault([EngineDeadError()]) is None
    assert engine().request_fault([EngineGenerateError("x")]) is None


def test_what_vllm_already_answers_as_a_client_error_is_left_alone():
    assert engine().request_fault([raised_in("entrypoints/openai/chat_completion/serving.py", ValueError)]) is None
    assert engine().request_fault([]) is None


def test_a_handlers_error_replies_are_noted_for_the_request_being_served():
    made = []
    create = _noting_errors(lambda message, *a, **k: made.append(message) or "reply")
    assert create("a message") == "reply"  # outside a request: nothing to note
    notes: list[BaseException] = []
    token = _serving_errors.set(notes)
    try:
        exc = IndexError("x")
        create(exc, status_code=500)
        create("text only")
    finally:
        _serving_errors.reset(token)
    assert notes == [exc] and made == ["a message", exc, "text only"]


def _collect(stream: Any) -> list[Any]:
    async def run() -> list[Any]:
        return [item async for item in stream]

    return asyncio.run(run())


def test_a_stream_the_request_broke_ends_with_its_fault_not_the_engines_error_event():
    broke = raised_in("entrypoints/openai/responses/serving.py")

    async def vllm_stream():
        yield "event: a\n\n"
        _serving_errors.get().append(broke)  # vLLM's layer caught it and made its 5xx event
        yield 'event: error\ndata: {"type":"error","code":500}\n\n'
        yield "event: never\n\n"

    items = _collect(engine()._attributed(vllm_stream()))
    assert items[0] == "event: a\n\n" and isinstance(items[1], RequestFault) and len(items) == 2


def test_a_stream_that_raises_is_attributed_too():
    async def raising(exc: BaseException):
        yield "data: 1\n\n"
        raise exc

    items = _collect(engine()._attributed(raising(raised_in("entrypoints/anthropic/serving.py", KeyError))))
    assert items[0] == "data: 1\n\n" and isinstance(items[1], RequestFault)
    with pytest.raises(IndexError):
        _collect(engine()._attributed(raising(raised_in("v1/engine/output_processor.py"))))


def test_an_engine_error_event_mid_stream_passes_as_the_replicas():
    async def vllm_stream():
        _serving_errors.get().append(raised_in("v1/engine/async_llm.py"))
        yield 'data: {"error": {"code": 500}}\n\n'
        yield "data: [DONE]\n\n"

    assert _collect(engine()._attributed(vllm_stream())) == ['data: {"error": {"code": 500}}\n\n', "data: [DONE]\n\n"]



@pytest.mark.parametrize("endpoint", ["chat", "completion", "responses", "messages"])
def test_the_event_a_replica_ends_a_faulted_stream_with_is_no_engine_failure_to_the_relay(endpoint):
    """What the gateway's relay reads from the replica's stream-ending event (a breaker failure or not)."""
    import json

    from shunter.deployments.gateway.relay import engine_failure
    from shunter.endpoints import ENDPOINTS
    from shunter.engine import REQUEST_FAULT_CODE

    def in_band(text: str) -> dict[str, Any] | None:
        if endpoint in ("chat", "completion"):
            return json.loads(text[len("data: "):])["error"]
        return ENDPOINTS[endpoint].wire.read_event(text).error

    assert engine_failure(in_band(ENDPOINTS[endpoint].wire.error_event("bad input", 400, REQUEST_FAULT_CODE))) is None
    assert engine_failure(in_band(ENDPOINTS[endpoint].wire.error_event("engine died", 500, "engine_error"))) is not None
