"""A replica killed outright (OOM killer, node trouble) takes its engine with it and gives back its cores.

The engine core and its worker are child processes of the replica; if they outlived it they would
keep computing on cores whose locks the kernel has just released to the replacement replica.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil

from .live import CAPITAL_QUESTION, CHAT_MODEL, EMBED_MODEL, assert_capital


def _ready(app) -> dict:
    resp = httpx.get(f"{app.base_url}/ready", timeout=30)
    return resp.json()["models"] if resp.status_code == 200 else {}


def test_killed_replica_is_replaced_without_leaking_engine_or_cores(live_app):
    before = _ready(live_app)[CHAT_MODEL]
    replica = psutil.Process(before["pid"])
    engine_procs = replica.children(recursive=True)
    assert engine_procs, "the engine runs in child processes of the replica"

    os.kill(before["pid"], signal.SIGKILL)

    gone, alive = psutil.wait_procs(engine_procs, timeout=30)
    assert not alive, f"engine processes outlived their replica: {alive}"

    deadline = time.monotonic() + 300
    after = {}
    while time.monotonic() < deadline:
        after = _ready(live_app)
        if after.get(CHAT_MODEL, {}).get("replica") not in (None, before["replica"]):
            break
        time.sleep(2)
    new = after[CHAT_MODEL]
    assert new["ready"] and new["replica"] != before["replica"]
    assert set(new["cpu_cores"]).isdisjoint(after[EMBED_MODEL]["cpu_cores"])

    resp = live_app.openai().chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": CAPITAL_QUESTION}], max_tokens=30,
        temperature=0)
    assert_capital(resp.choices[0].message.content, live_app.base_url)
