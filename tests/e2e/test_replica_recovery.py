"""A replica killed outright (OOM killer, node trouble) takes its engine with it and gives back its cores.

The engine core and its worker are forked for the replica by the node's fork server (or spawned as its
children); if they outlived it they would keep computing on cores whose locks the kernel has just
released to the replacement replica.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil

from shunter.engine import START_PHASES

from .live import CAPITAL_QUESTION, CHAT_MODEL, EMBED_MODEL, assert_capital


def _ready(app) -> dict:
    resp = httpx.get(f"{app.base_url}/ready", timeout=30)
    return resp.json()["models"] if resp.status_code == 200 else {}


def _replaced(app, before: dict) -> dict:
    """/ready's models once the chat model answers from a replica other than `before`'s (asserted)."""
    deadline = time.monotonic() + 300
    after: dict = {}
    while time.monotonic() < deadline:
        after = _ready(app)
        if after.get(CHAT_MODEL, {}).get("replica") not in (None, before["replica"]):
            break
        time.sleep(1)
    new = after.get(CHAT_MODEL, {})
    assert new.get("ready") and new["replica"] != before["replica"], f"the replica was not replaced: {new}"
    return after


def test_killed_replica_is_replaced_without_leaking_engine_or_cores(live_app):
    before = _ready(live_app)[CHAT_MODEL]
    engine_procs = [psutil.Process(pid) for pid in before["engine_pids"]]
    assert engine_procs, "the replica names its engine's processes"

    os.kill(before["pid"], signal.SIGKILL)

    gone, alive = psutil.wait_procs(engine_procs, timeout=30)
    assert not alive, f"engine processes outlived their replica: {alive}"

    after = _replaced(live_app, before)
    new = after[CHAT_MODEL]
    assert set(new["cpu_cores"]).isdisjoint(after[EMBED_MODEL]["cpu_cores"])

    resp = live_app.openai().chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": CAPITAL_QUESTION}], max_tokens=30,
        temperature=0)
    assert_capital(resp.choices[0].message.content, live_app.base_url)


def test_an_engine_core_killed_is_noticed_and_its_replica_replaced_on_the_fork_servers_path(live_app):
    """The engine core dies alone (OOM killer): vLLM's monitor sees its sentinel fire through the node's
    fork server, the health check fails, Serve replaces the replica, and the new engine comes from the same
    server (not the replica's children: forked, no imports paid again)."""
    before = _ready(live_app)[CHAT_MODEL]
    replica = psutil.Process(before["pid"])
    core = psutil.Process(before["engine_pids"][0])
    assert core.pid not in {child.pid for child in replica.children(recursive=True)}, \
        "the engine core is forked by the node's server, not spawned by the replica"
    server = core.parent()
    assert "shunter.engine_forkserver" in " ".join(server.cmdline())
    engine_procs = [psutil.Process(pid) for pid in before["engine_pids"]]

    core.kill()

    gone, alive = psutil.wait_procs(engine_procs, timeout=30)
    assert not alive, f"the killed core's workers outlived it: {alive}"
    new = _replaced(live_app, before)[CHAT_MODEL]
    assert psutil.Process(new["engine_pids"][0]).parent().pid == server.pid, "the same server forked the new core"
    phases = new["start"]["phases"]
    assert list(phases) == list(START_PHASES), "every phase of the start, in order"
    resp = live_app.openai().chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": CAPITAL_QUESTION}], max_tokens=30,
        temperature=0)
    assert_capital(resp.choices[0].message.content, live_app.base_url)
