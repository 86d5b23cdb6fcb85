"""The bench's CPU split: an engine's processes are the engine, whether or not their vLLM title reached
their command line; the rest is the serving side."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from shunter.bench.cpu import CpuMeter

pytestmark = pytest.mark.unit

# A stand-in replica titled as Serve titles one, starting an untitled spawn child (as vLLM starts its
# engine core) that burns CPU, and a titled engine worker that burns CPU too.
TREE = textwrap.dedent("""
    import multiprocessing, time, setproctitle

    def burn(title):
        if title:
            setproctitle.setproctitle(title)
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            pass

    if __name__ == "__main__":
        setproctitle.setproctitle("ray::ServeReplica:app:model-x")
        spawn = multiprocessing.get_context("spawn")
        children = [spawn.Process(target=burn, args=(t,)) for t in ("", "VLLM::Worker_TP0")]
        for c in children:
            c.start()
        for c in children:
            c.join()
""")


def test_an_engine_is_the_engine_whether_or_not_its_title_shows(tmp_path):
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    meter = CpuMeter()
    proc = subprocess.Popen([sys.executable, str(script)])
    time.sleep(1.0)  # the children run: the meter sees them before and after
    meter.start()
    time.sleep(1.0)
    use = meter.stop()
    assert proc.wait(timeout=60) == 0
    assert use.engine_s >= 0.3, use
    assert not any("multiprocessing.spawn" in label for label, _ in use.top), use.top
