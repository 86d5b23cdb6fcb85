"""A LoRA adapter rolled out to new files: the control actor runs the models' rollout state machine under
the adapter's key, the gateway splits the adapter's requests between its two versions by the live
weights, and the end leaves the adapter on the new files (promoted) or the old (rolled back). The actor's
class runs without Ray (tests/unit/test_control_races.py), the clock is the test's."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from shunter.config import parse_config
from shunter.deployments.gateway.lora import LiveAdapters, version_label
from shunter.ops.control import ShunterControl
from tests.unit.fake_clock import Clock
from tests.unit.test_control_races import MemoryStore

ROLLOUT = {"steps": [50, 100], "hold_s": 10, "max_hold_s": 60, "gates": {"min_requests": 2}}


def _adapter_dir(root, name: str) -> str:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return str(path)


def _setup(tmp_path):
    cfg = parse_config({"models": [{"name": "chat", "source": "builtin:smollm2-135m-instruct", "rollout": ROLLOUT,
                                    "adapters": [{"name": "legal", "source": _adapter_dir(tmp_path, "v1")}]}]})
    clock = Clock(1000.0)
    control = ShunterControl("app1", store=MemoryStore(), clock=clock)
    control._status = lambda: SimpleNamespace(applications={})  # no deployment is asked about
    control._ensure_loop = lambda: None
    live = LiveAdapters(cfg)
    return live, live.find("legal"), control, clock, _adapter_dir(tmp_path, "v2")


def _serve(control: ShunterControl, key: str, clock: Clock, version: str, ok: bool, n: int = 3) -> None:
    asyncio.run(control.report(key, [(version, clock.now, ok, 0.1, 0.2)] * n))


def test_an_adapter_rolls_out_to_new_files_and_ends_on_them(tmp_path):
    live, adapter, control, clock, new_dir = _setup(tmp_path)
    context = live.rollout_context(adapter, new_dir)
    old, new = context["versions"]
    assert (old, new) == (version_label(adapter.source), version_label(new_dir))
    key = adapter.rollout_key
    asyncio.run(control.start_rollout(context, new, ROLLOUT))
    asyncio.run(control._tick_all())  # nothing to start: straight to the first step
    assert control.state["rollouts"][key]["rollout"]["phase"] == "shifting"

    live.refresh(control.state)
    routes = {live.route(adapter, f"user-{i}") for i in range(200)}
    assert {(r.engine_name, r.source, r.version) for r in routes} == {
        ("legal", adapter.source, old), (f"legal@{new}", new_dir, new)}, "half and half, each its own files"
    assert live.route(adapter, "user-7") == live.route(adapter, "user-7"), "a conversation keeps its version"
    assert live.rolling_out(adapter)

    for _ in range(2):  # 50%, then 100%: each step's gates see both versions serve well
        _serve(control, key, clock, old, True)
        _serve(control, key, clock, new, True)
        clock.now += 11
        asyncio.run(control._tick_all())
    asyncio.run(control._tick_all())  # promoted: the old version has nothing to drain
    entry = control.state["rollouts"][key]["rollout"]
    assert (entry["phase"], entry["outcome"]) == ("done", "promoted"), entry["history"]

    live.refresh(control.state)
    moved = live.find("legal")
    assert moved.source == new_dir and moved.origin == "admin" and not live.rolling_out(moved)
    assert live.route(moved, "user-1").engine_name == "legal" and live.route(moved, "user-1").version is None


def test_an_adapter_version_that_fails_its_gates_is_rolled_back_and_the_old_files_stay(tmp_path):
    live, adapter, control, clock, new_dir = _setup(tmp_path)
    context = live.rollout_context(adapter, new_dir)
    old, new = context["versions"]
    asyncio.run(control.start_rollout(context, new, ROLLOUT))
    asyncio.run(control._tick_all())
    _serve(control, adapter.rollout_key, clock, old, True)
    _serve(control, adapter.rollout_key, clock, new, False)
    asyncio.run(control._tick_all())  # judged as soon as it shows: no wait for the hold
    asyncio.run(control._tick_all())
    entry = control.state["rollouts"][adapter.rollout_key]["rollout"]
    assert (entry["phase"], entry["outcome"]) == ("done", "rolled_back"), entry["history"]
    assert "error rate" in entry["history"][-2]["reason"]
    live.refresh(control.state)
    assert live.find("legal").source == adapter.source and not live.rolling_out(live.find("legal"))
