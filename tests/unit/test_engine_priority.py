"""A CPU engine's processes yield to the platform's: `engine.cpu_nice` (shunter.engine.lower_engine_priority)."""

from __future__ import annotations

import subprocess
import sys

import psutil

from shunter.config import parse_config
from shunter.engine import lower_engine_priority


def test_engine_processes_are_reniced_up_never_down():
    """A CPU engine's core and worker processes are the replica's children: they yield to the platform's
    processes (engine.cpu_nice, default 19); a process already nicer is left alone."""
    assert parse_config({"models": [{"name": "m", "source": "builtin:smollm2-135m-instruct"}]}) \
        .models[0].engine.cpu_nice == 19
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(2)]
    try:
        psutil.Process(sleepers[1].pid).nice(19)
        own = psutil.Process().nice()
        changed = lower_engine_priority(max(own, 17))
        assert psutil.Process(sleepers[0].pid).nice() == max(own, 17)
        assert psutil.Process(sleepers[1].pid).nice() == 19, "never lowered"
        assert sleepers[1].pid not in changed and psutil.Process().nice() == own, "the replica keeps its own"
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()
