"""The bench's CPU split: an engine's processes are the engine, whether or not their vLLM title reached
their command line; the rest is the serving side."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from shunter.bench.cpu import CpuMeter

pytestmark = pytest.mark.unit

# A stand-in replica titled as Serve titles one, starting an untitled spawn child (as vLLM starts its
# engine core) that burns CPU, and a titled engine worker that burns CPU too. Each burner says it runs
# (a file named by its pid in the folder given) and burns until the test says stop (a file `stop`), or
# for two minutes at most should the test die first.
BURN = """
def burn(folder, title=""):
    import os, pathlib, time, setproctitle
    if title:
        setproctitle.setproctitle(title)
    folder = pathlib.Path(folder)
    (folder / f"running-{os.getpid()}").touch()
    stop, end = folder / "stop", time.monotonic() + 120
    while not stop.exists() and time.monotonic() < end:
        for _ in range(10000):
            pass
"""

TREE = BURN + textwrap.dedent("""
    import multiprocessing, sys, setproctitle

    if __name__ == "__main__":
        setproctitle.setproctitle("ray::ServeReplica:app:model-x")
        spawn = multiprocessing.get_context("spawn")
        children = [spawn.Process(target=burn, args=(sys.argv[1], t)) for t in ("", "VLLM::Worker_TP0")]
        for c in children:
            c.start()
        for c in children:
            c.join()
""")


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _wait(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _measure(tmp_path, tree: str, burners: int, *args: str) -> None:
    """Run the process tree and meter it while its burners run: each burner's CPU, as psutil reads it
    between the meter's start and stop, is the engine's, and no untitled spawn child is left among the
    serving side's processes. No fixed window: the burners run until each has used a share of CPU."""
    script = tmp_path / "tree.py"
    script.write_text(tree)
    folder = tmp_path / "signals"
    folder.mkdir()
    meter = CpuMeter()
    proc = subprocess.Popen([sys.executable, str(script), str(folder), *args])
    try:
        _wait(lambda: len(list(folder.glob("running-*"))) == burners, "the burners never ran")
        pids = [int(path.name.removeprefix("running-")) for path in folder.glob("running-*")]
        meter.start()
        before = {pid: _cpu_s(pid) for pid in pids}
        _wait(lambda: all(_cpu_s(pid) - before[pid] >= 0.3 for pid in pids), "the burners never burned")
        burned = sum(_cpu_s(pid) - before[pid] for pid in pids)
        use = meter.stop()
    finally:
        (folder / "stop").touch()
        try:
            proc.wait(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 0
    # The meter read every burner before `before` and after `burned`: at least that much is the engine's.
    assert use.engine_s >= burned, (use, burned)
    assert not any("multiprocessing.spawn" in label or "VLLM::" in label for label, _ in use.top), use.top


def test_an_engine_is_the_engine_whether_or_not_its_title_shows(tmp_path):
    _measure(tmp_path, TREE, burners=2)


# The engine core untitled, and its worker too (a spawn child of the core, as vLLM's CPU workers are).
NESTED = BURN + textwrap.dedent("""
    import multiprocessing, sys, setproctitle

    def core(folder):
        worker = multiprocessing.get_context("spawn").Process(target=burn, args=(folder,))
        worker.start()
        worker.join()

    if __name__ == "__main__":
        setproctitle.setproctitle("ray::ServeReplica:app:model-x")
        child = multiprocessing.get_context("spawn").Process(target=core, args=(sys.argv[1],))
        child.start()
        child.join()
""")


def test_a_worker_of_an_untitled_engine_core_is_the_engine_too(tmp_path):
    _measure(tmp_path, NESTED, burners=1)


# Shunter's fork server (its command line names `shunter.engine_forkserver`) forking an engine core, which
# keeps the server's command line: vLLM's title never reaches it.
FORKED = BURN + textwrap.dedent("""
    import os, sys

    if __name__ == "__main__":
        pid = os.fork()
        if pid == 0:
            burn(sys.argv[1])
            os._exit(0)
        os.waitpid(pid, 0)
""")


def test_a_process_forked_by_the_fork_server_is_the_engine(tmp_path):
    _measure(tmp_path, FORKED, 1, "-m", "shunter.engine_forkserver")
