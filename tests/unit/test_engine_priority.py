"""A CPU model replica and its engine yield to the platform's processes: `engine.cpu_nice`
(shunter.engine.yield_cpu_to_platform), raised once the engine is ready, on the replica's thread, its
children and the engine's processes wherever they were started (a fork server's children are not the
replica's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shunter.config import parse_config

PROBE = """
import os, subprocess, sys, threading, psutil
from shunter.engine import yield_cpu_to_platform
start = int(sys.argv[1])
if start > os.getpriority(os.PRIO_PROCESS, 0):
    os.setpriority(os.PRIO_PROCESS, 0, start)  # this thread (raising needs no privilege)
stop = threading.Event()
worker = threading.Thread(target=stop.wait)  # one of Ray's threads in the replica: left alone
worker.start()
early = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])  # a spawned engine core
forked = int(sys.argv[2])  # an engine core a fork server made: no child of this process
yield_cpu_to_platform(17, [forked])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
def niceness(pid):
    return {os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(pid).threads()}
print(os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, worker.native_id),
      *[sorted(niceness(pid)) for pid in (early.pid, child.pid, forked)])
stop.set(); child.kill(); early.kill()
"""


def _probe(start: int) -> list[str]:
    """The probe's niceness after yield_cpu_to_platform(17, [a process that is not its child]): its own
    thread's, another thread's, its children's made before and after, and the other process's. It starts
    at `start`, or at this process's niceness if that is higher (a suite run under `nice` starts there,
    and niceness cannot be lowered without a privilege); so does the other process."""
    forked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                              preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, max(start, os.getpriority(
                                  os.PRIO_PROCESS, 0))))
    try:
        out = subprocess.run([sys.executable, "-c", PROBE, str(start), str(forked.pid)], capture_output=True,
                             text=True, timeout=60)
    finally:
        forked.kill()
        forked.wait()
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_replica_and_what_it_starts_run_at_the_configured_niceness():
    assert parse_config({"models": [{"name": "m", "source": "builtin:smollm2-135m-instruct"}]}) \
        .models[0].engine.cpu_nice == 19
    base = os.getpriority(os.PRIO_PROCESS, 0)  # what the probe inherits: not necessarily 0
    if base >= 17:
        pytest.skip(f"the suite runs at niceness {base}: nothing below 17 to raise")
    assert _probe(base) == ["17", str(base), "[17]", "[17]", "[17]"], \
        "the caller, its children made before and after and the engine's other processes are raised; the " \
        "other thread is left alone"


def test_niceness_is_never_lowered():
    assert _probe(19) == ["19", "19", "[19]", "[19]", "[19]"]
