"""Targets the fork-server unit tests have the server run (importable by module name, as vLLM's are)."""

from __future__ import annotations

import os
import sys
import time


def report(path: str, code: int = 0) -> None:
    """Writes what the child sees (environment, cwd, niceness, process group), then exits with `code`."""
    with open(path, "w") as f:
        f.write(f"{os.environ.get('FORK_TEST')}|{os.getcwd()}|{os.getpriority(os.PRIO_PROCESS, 0)}|"
                f"{os.getpgid(0) == os.getpid()}|{os.environ.get('VLLM_WORKER_MULTIPROC_METHOD')}")
    print("child says hello", flush=True)
    sys.exit(code)


def sleep_with_child(path: str) -> None:
    """Forks a grandchild (as an engine core forks its workers), names both, then sleeps."""
    grandchild = os.fork()
    if grandchild == 0:
        from shunter.engine_forkserver import _die_with_parent

        _die_with_parent()  # as vLLM's workers watch their engine core
        time.sleep(600)
        os._exit(0)
    # Written whole, then renamed: a test waiting for the file never reads it half-written.
    with open(f"{path}.part", "w") as f:
        f.write(f"{os.getpid()} {grandchild}")
    os.replace(f"{path}.part", path)
    time.sleep(600)


def exit_when(path: str) -> None:
    """Runs until `path` exists, then exits: the test decides when the child ends."""
    while not os.path.exists(path):
        time.sleep(0.01)
    sys.exit(0)


def ray_probe(path: str) -> None:
    """Writes whether the probe module (preloaded by the server, with Ray kept out) sees ray here, and whether
    ray's native configuration reads this process's environment (RAY_maximum_gcs_destroyed_actor_cached_count)."""
    from ray._raylet import Config

    from tests.unit import forkserver_ray_probe

    with open(path, "w") as f:
        f.write(f"{forkserver_ray_probe.ray is not None}|{Config.maximum_gcs_destroyed_actor_cached_count()}")


def openmp_report(path: str) -> None:
    """Writes the torch threads and cores this child runs with, then forks a 'worker' the way vLLM's CPU
    executor starts one (its OpenMP variables set in the environment just before) that writes its own."""
    import torch

    def seen() -> str:
        return f"{torch.get_num_threads()} {','.join(map(str, sorted(os.sched_getaffinity(0))))}"

    core = seen()
    worker_core = min(os.sched_getaffinity(0))
    os.environ.update({"OMP_NUM_THREADS": "1", "OMP_PLACES": f"{{{worker_core}}}", "OMP_PROC_BIND": "true"})
    worker = os.fork()
    if worker == 0:
        with open(f"{path}.worker", "w") as f:
            f.write(seen())
        os._exit(0)
    os.waitpid(worker, 0)
    with open(f"{path}.part", "w") as f:
        f.write(f"{core}|{open(f'{path}.worker').read()}")
    os.replace(f"{path}.part", path)
