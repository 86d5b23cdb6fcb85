"""Model replicas' Ray workers forked from the node's pre-imported server instead of started cold (issue 41).

Why: the engine core was already forked (shunter.engine_forkserver), but the replica itself is a Ray
worker that Ray starts as a fresh interpreter, and the first thing it did was import vLLM and torch to
configure its engine: 10-12 s on a quiet 2-core AVX2 machine, 18 s on a first deploy, up to 54 s while
other engines start or serve. That import was the largest phase of every replica start that remained.

How: Ray starts a deployment's workers with its runtime_env's `py_executable` in place of `python`. A CPU
model deployment's is `python -m shunter.worker_fork` (`EXECUTABLE`, set by shunter.serve_plan unless the
model's `engine.process_start` is spawn): this launcher asks the node's server to fork a child that runs
Ray's own worker entry point with the launcher's arguments, environment, working directory and output
files, and stays in its place until the child ends:

- Ray registers the worker under the pid it reports, the child's, so Ray's kills, its memory monitor and
  Serve's health checks all reach the child itself.
- Whatever ends the launcher (the raylet kills it, it is killed outright) closes its connection, and the
  server kills the child; the launcher exits with the child's exit status, or by the signal that ended it.
- SIGTERM and SIGINT sent to the launcher are passed on to the child.
- The server keeps Ray out of its imports (`ForkServer.preload`): a child then builds Ray's native
  configuration from its own environment, as a cold worker does.

When no server is ready (the first replica on a node, while the server imports), the launcher waits for it,
within Ray's time for a worker to register; past that, or when the server cannot be reached, it becomes a
plain cold worker (exec), which starts as before.

A first wiring was parked: with forked replicas a 32-stream flood on two engines finished nothing in
300 s. The cause was not the replica: the engines' OpenMP runtimes ignored their core binding on the fork
path and ran the server's environment's thread count, which a launcher-started server left at all of the
node's cores (fixed for every forked process by shunter.openmp_env).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import runpy
import signal
import sys
import time
from pathlib import Path

from shunter.engine_forkserver import (
    ForkedProcess,
    connect,
    node_server,
    ready_marker,
    server_address,
    session_pid,
)

# The runtime_env `py_executable` of a model deployment's workers (this interpreter: the venv Ray runs in).
EXECUTABLE = f"{sys.executable} -m shunter.worker_fork"

# Ray gives a starting worker this long to register (its `worker_register_timeout_seconds`) before it
# counts the start as failed; the launcher keeps a margin for the forked worker's own start.
_RAY_REGISTER_TIMEOUT_S = 60.0
_START_MARGIN_S = 15.0

# What the server put on sys.path for itself (its working directory, its PYTHONPATH), read when the server
# imports this module: a forked worker's path is its own, as a cold one's would be.
_SERVER_PATH_ENTRIES = [sys.path[0], *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]


def run_ray_worker(argv: list[str]) -> None:
    """The forked child: Ray's worker entry point (argv[0], default_worker.py) with its arguments, in the
    state a fresh `python default_worker.py ...` would be in (the server already set the environment,
    working directory, output files and niceness)."""
    logging.root.handlers.clear()  # the server's own log format is not the worker's
    logging.root.setLevel(logging.WARNING)
    multiprocessing.current_process().name = "MainProcess"
    script = os.path.abspath(argv[0])
    own = [os.path.dirname(script), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[:] = own + [p for p in sys.path if p not in own and p not in _SERVER_PATH_ENTRIES]
    sys.argv = [script, *argv[1:]]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # the server's child ends with os._exit, which skips them


def _ready_server(wait_s: float) -> Path | None:
    """The address of this node's server once it has imported its modules (starting it when none runs),
    or None when it is not ready within `wait_s`."""
    address = server_address(session_pid())
    deadline = time.monotonic() + wait_s
    started = False
    while True:
        if ready_marker(address).exists():
            with contextlib.suppress(OSError):
                connect(address, 5.0).close()
                return address
        if not started:
            node_server()  # starts it unless one answers (a stale marker and socket are removed)
            started = True
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def _register_wait_s() -> float:
    configured = os.environ.get("RAY_worker_register_timeout_seconds", "")
    timeout = float(configured) if configured.isdigit() else _RAY_REGISTER_TIMEOUT_S
    return max(0.0, timeout - _START_MARGIN_S)


def _exec_cold(argv: list[str], why: str) -> None:
    print(f"shunter.worker_fork: starting a cold worker: {why}", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, *argv])


def main(argv: list[str] | None = None) -> int:
    """`python -m shunter.worker_fork SCRIPT ARGS...`: runs `python SCRIPT ARGS...` as a child of the
    node's server, and exits as it exits."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        address = _ready_server(_register_wait_s())
    except Exception as exc:  # noqa: BLE001 - a worker starts either way
        address, why = None, f"the node's fork server could not be started ({exc})"
    else:
        why = "the node's fork server was not ready in time"
    if address is None:
        _exec_cold(argv, why)
    # By its importable name: run as `-m`, this module is __main__, which the server cannot import.
    from shunter.worker_fork import run_ray_worker as target

    child = ForkedProcess(address, target, "MainProcess", {"argv": argv})
    try:
        child.start()
    except (OSError, RuntimeError) as exc:
        _exec_cold(argv, str(exc))

    def pass_on(signum: int, _: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)  # type: ignore[arg-type]

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, pass_on)
    child.join()
    code = child.exitcode if child.exitcode is not None else 1
    if code < 0:  # ended by a signal: end the same way, so the raylet sees what a cold worker would show
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
