"""A CPU model replica and its engine yield to the platform's processes: `engine.cpu_nice`
(shunter.engine.yield_cpu_to_platform), raised before the engine starts so its processes inherit it."""

from __future__ import annotations

import subprocess
import sys

from shunter.config import parse_config

PROBE = """
import os, subprocess, sys, threading, time, psutil
from shunter.engine import yield_cpu_to_platform
start = int(sys.argv[1])
if start:
    os.setpriority(os.PRIO_PROCESS, 0, start)  # this thread
stop = threading.Event()
worker = threading.Thread(target=stop.wait)  # one of Ray's threads in the replica: left alone
worker.start()
early = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])  # a fork server, say
yield_cpu_to_platform(17)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
time.sleep(0.2)
def niceness(pid):
    return {os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(pid).threads()}
print(os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, worker.native_id),
      *[sorted(niceness(pid)) for pid in (early.pid, child.pid)])
stop.set(); child.kill(); early.kill()
"""


def _probe(start: int) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(start)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_replica_and_what_it_starts_run_at_the_configured_niceness():
    assert parse_config({"models": [{"name": "m", "source": "builtin:smollm2-135m-instruct"}]}) \
        .models[0].engine.cpu_nice == 19
    assert _probe(0) == ["17", "0", "[17]", "[17]"], "the caller and the children made before and after"


def test_niceness_is_never_lowered():
    assert _probe(19) == ["19", "19", "[19]", "[19]"]
