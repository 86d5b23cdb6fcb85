"""The control actor's loop against its commands (ops/control.py). A tick reads a rollout, awaits Ray's
status, then saves the rollout's next step; an operator's pause or rollback can land during that await
and must stand. The interleavings are forced: Ray's status answers only when the test lets it. The
actor's class runs without Ray, its state kept in a dict; the clock is the test's."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

from shunter.ops.control import ShunterControl, read_state
from tests.unit.fake_clock import Clock

ROLLOUT = {"steps": [10, 50, 100], "hold_s": 30, "max_hold_s": 120, "ready_timeout_s": 300, "gates": {}}


def _context(model: str) -> dict[str, Any]:
    return {"model": model, "fingerprint": "f1", "versions": ["v1", "v2"],
            "file_weights": [["v1", 100.0], ["v2", 0.0]],
            "deployments": {"v1": f"model-{model}--v1", "v2": f"model-{model}--v2"}, "ready_replicas": 1,
            "rollout": ROLLOUT}


class MemoryStore:
    """Ray's key-value store as the actor uses it."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}

    def get(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def put(self, key: bytes, value: bytes) -> None:
        self.data[key] = value


class HeldStatus:
    """`serve.status()` of an app whose every deployment runs one healthy replica. It answers only once
    the test sets `answer` (the actor calls it in a worker thread); `asked` says a tick is waiting on it."""

    def __init__(self, app: str, *models: str) -> None:
        healthy = SimpleNamespace(replica_states={"RUNNING": 1}, status="HEALTHY", message="",
                                  status_trigger="CONFIG_UPDATE_COMPLETED")
        names = [name for m in models for name in _context(m)["deployments"].values()]
        self.status = SimpleNamespace(applications={
            app: SimpleNamespace(deployments={name: healthy for name in names})})
        self.asked, self.answer = threading.Event(), threading.Event()

    def __call__(self) -> SimpleNamespace:
        self.asked.set()
        assert self.answer.wait(10), "the test never let Ray's status answer"
        return self.status


def _control(status: HeldStatus, clock: Clock, store: MemoryStore) -> ShunterControl:
    control = ShunterControl("app1", store=store, clock=clock)
    control._status = status
    control._ensure_loop = lambda: None  # no background loop: the test runs the loop's passes itself
    return control


async def _asked(status: HeldStatus) -> None:
    assert await asyncio.to_thread(status.asked.wait, 10), "no tick asked for Ray's status"


async def _tick_held_on_ray(control: ShunterControl, status: HeldStatus, clock: Clock) -> asyncio.Task:
    """Start smol's rollout to v2, ready by now, and a tick that is held waiting for Ray's status."""
    await control.start_rollout(_context("smol"), "v2")
    clock.now += 5
    tick = asyncio.create_task(control._tick_all())  # v2 is ready: this tick would shift 10% to it
    await _asked(status)
    return tick


def _rollout(control: ShunterControl, model: str = "smol") -> dict[str, Any]:
    return control.state["rollouts"][model]["rollout"]


def test_a_rollback_that_lands_while_a_tick_awaits_is_not_overwritten():
    clock, store = Clock(1000.0), MemoryStore()
    status = HeldStatus("app1", "smol")
    control = _control(status, clock, store)

    async def scenario() -> None:
        tick = await _tick_held_on_ray(control, status, clock)
        await asyncio.wait_for(control.rollback("smol"), 5)  # not held up by Ray's status
        status.answer.set()
        await tick

    asyncio.run(scenario())
    assert _rollout(control)["phase"] == "rolling_back"
    assert control.state["models"]["smol"]["weights"] == [["v2", 0.0], ["v1", 100.0]]
    assert control.state["models"]["smol"]["live"] == ["v1"]
    saved = read_state("app1", store)  # what the gateways read
    assert saved["rollouts"]["smol"]["rollout"]["phase"] == "rolling_back"
    assert saved["models"]["smol"] == control.state["models"]["smol"]


def test_a_pause_that_lands_while_a_tick_awaits_holds_the_rollout_and_resume_carries_it_on():
    clock, store = Clock(1000.0), MemoryStore()
    status = HeldStatus("app1", "smol")
    control = _control(status, clock, store)

    async def scenario() -> None:
        tick = await _tick_held_on_ray(control, status, clock)
        await asyncio.wait_for(control.pause("smol"), 5)
        status.answer.set()
        await tick
        assert _rollout(control)["phase"] == "deploying" and _rollout(control)["paused_at"] == 1005.0
        assert read_state("app1", store)["rollouts"]["smol"]["rollout"]["paused_at"] == 1005.0
        clock.now += 60
        await control._tick_all()
        assert _rollout(control)["phase"] == "deploying", "a paused rollout stays where it is"
        await control.resume("smol")
        await control._tick_all()

    asyncio.run(scenario())
    assert _rollout(control)["phase"] == "shifting" and _rollout(control)["step_started_at"] == 1065.0
    assert control.state["models"]["smol"]["weights"] == [["v2", 10.0], ["v1", 90.0]]


def test_a_pass_judges_each_model_on_its_rollout_as_it_is_when_its_turn_comes():
    clock, store = Clock(1000.0), MemoryStore()
    status = HeldStatus("app1", "smol", "tiny")
    control = _control(status, clock, store)

    async def scenario() -> None:
        await control.start_rollout(_context("smol"), "v2")
        await control.start_rollout(_context("tiny"), "v2")
        clock.now += 5
        loop_pass = asyncio.create_task(control._tick_all())
        await _asked(status)  # smol's tick awaits; tiny's comes next
        await asyncio.wait_for(control.pause("tiny"), 5)
        status.answer.set()
        await loop_pass

    asyncio.run(scenario())
    assert _rollout(control, "smol")["phase"] == "shifting"
    assert _rollout(control, "tiny")["phase"] == "deploying" and _rollout(control, "tiny")["paused_at"] == 1005.0
    assert control.state["models"]["tiny"]["weights"] == [["v2", 0.0], ["v1", 100.0]]
