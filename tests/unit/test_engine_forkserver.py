"""The node's engine fork server (shunter.engine_forkserver) with a tiny preload, no vLLM: what vLLM's
process manager relies on of a process (start, sentinel, exitcode, join, terminate), what the child
inherits from the replica that asked, and that nothing it forked outlives its requester or its session."""

from __future__ import annotations

import multiprocessing.connection
import os
import select
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from shunter import engine_forkserver
from shunter.engine_forkserver import ForkContext, server_address

from . import forkserver_targets
from .conftest import ROOT
from .conftest import wait_until as _wait


def _engine_with_a_worker(context, tmp_path) -> tuple:
    """A forked 'engine core' that forked a 'worker' of its own, both running: (process, core, worker)."""
    process = context.Process(target=forkserver_targets.sleep_with_child, kwargs={"path": str(tmp_path / "pids")})
    process.start()
    _wait((tmp_path / "pids").exists)
    core, worker = (psutil.Process(int(pid)) for pid in (tmp_path / "pids").read_text().split())
    return process, core, worker


def test_the_socket_directory_is_this_users_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_forkserver.tempfile, "gettempdir", lambda: str(tmp_path))
    address = server_address(1)
    assert address.parent.stat().st_mode & 0o777 == 0o700
    assert server_address(1) == address and server_address(2) != address, "one server per session"
    address.parent.chmod(0o755)
    with pytest.raises(PermissionError):
        server_address(1)


def test_a_child_runs_with_the_requesters_environment_and_reports_its_exit(server, tmp_path, monkeypatch):
    context, _, _ = server
    out = tmp_path / "seen"
    monkeypatch.setenv("FORK_TEST", "from-the-replica")
    monkeypatch.chdir(tmp_path)
    process = context.Process(target=forkserver_targets.report, name="EngineCore",
                              kwargs={"path": str(out), "code": 3})
    assert context.made == [process]
    process.start()
    assert process.pid and process.pid != os.getpid()
    assert multiprocessing.connection.wait([process.sentinel], timeout=20), "the sentinel fires at exit"
    assert process.exitcode == 3 and not process.is_alive()
    env, cwd, nice, own_group, method = out.read_text().split("|")
    assert env == "from-the-replica" and cwd == str(tmp_path)
    assert int(nice) == os.getpriority(os.PRIO_PROCESS, 0), "the niceness of the thread that asked"
    assert own_group == "True", "its own process group: killed with its workers"
    assert method == "fork", "its workers are forked from it, not spawned"


def test_terminate_and_join_end_a_child(server, tmp_path):
    context, _, _ = server
    process = context.Process(target=forkserver_targets.sleep_with_child, kwargs={"path": str(tmp_path / "pids")})
    process.start()
    _wait((tmp_path / "pids").exists)
    process.terminate()
    process.join(20)
    assert process.exitcode == -signal.SIGTERM


def test_a_requester_that_dies_takes_its_engine_and_the_engines_children_with_it(server, tmp_path):
    _, _, _ = server
    pids = tmp_path / "pids"
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
            "from shunter.engine_forkserver import ForkContext\n"
            "from tests.unit import forkserver_targets\n"
            f"p = ForkContext(__import__('pathlib').Path({str(server[0].address)!r})).Process("
            f"target=forkserver_targets.sleep_with_child, kwargs={{'path': {str(pids)!r}}})\n"
            "p.start(); time.sleep(600)\n")
    requester = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    _wait(pids.exists)
    core, worker = (psutil.Process(int(pid)) for pid in pids.read_text().split())
    requester.kill()  # SIGKILL: nothing of its own runs
    requester.wait()
    gone, alive = psutil.wait_procs([core, worker], timeout=20)
    assert not alive, f"outlived their requester: {alive}"


def test_the_server_and_what_it_forked_end_with_the_session(server, tmp_path):
    context, session, proc = server
    process, core, worker = _engine_with_a_worker(context, tmp_path)
    session.kill()
    proc.wait(20)
    gone, alive = psutil.wait_procs([core, worker], timeout=20)
    assert not alive and not context.address.exists()
    assert multiprocessing.connection.wait([process.sentinel], timeout=5)
    assert process.exitcode is not None


def test_a_server_killed_outright_takes_its_engines(server, tmp_path):
    context, _, proc = server
    process, core, worker = _engine_with_a_worker(context, tmp_path)
    proc.kill()
    gone, alive = psutil.wait_procs([core, worker], timeout=20)
    assert not alive, "no engine runs on, unowned"
    process.join(5)
    assert process.exitcode is not None, "its replica sees it gone"


def test_an_unknown_target_is_an_error_for_the_requester_not_the_server(server, tmp_path):
    context, _, proc = server

    def not_importable() -> None:  # a local function: the server cannot find it by name
        pass

    process = context.Process(target=not_importable)
    with pytest.raises(RuntimeError, match="could not start"):
        process.start()
    assert proc.poll() is None, "the server still serves"
    ok = context.Process(target=forkserver_targets.report, kwargs={"path": str(tmp_path / "x")})
    ok.start()
    ok.join(20)
    assert ok.exitcode == 0


def test_a_child_that_exits_as_its_requester_leaves_is_settled_once_and_the_server_serves_on(tmp_path, monkeypatch):
    """A replica stopping shuts its engine down and closes its connection: the server can see the child's
    exit and the requester's close in one batch of events. Settling both crashed the server (a second
    waitpid), and every engine on the node died with it (seen in the suite: a scale-down killed the
    remaining replica's engine). Driven in this process, one batch at a time, so the two events are
    surely ready together."""
    monkeypatch.setattr(engine_forkserver.tempfile, "gettempdir", lambda: str(tmp_path))
    session = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    address = server_address(session.pid)
    server = engine_forkserver.ForkServer(address, session.pid)
    server.watch()
    try:
        for round_ in range(2):  # the second: the server still forks after the first
            end = tmp_path / f"end{round_}"
            process = ForkContext(address).Process(target=forkserver_targets.exit_when, kwargs={"path": str(end)})
            starter = threading.Thread(target=process.start)
            starter.start()
            while starter.is_alive():  # the request, then the fork and the reply with the child's pid
                assert server.handle(server.selector.select(timeout=0.1))
            (child,) = server.children.values()
            end.touch()
            assert select.select([child.pidfd], [], [], 20)[0], "the child has exited..."
            process._sock.close()  # ...and its requester leaves, both before the server looks
            events = server.selector.select(timeout=5)
            assert {key.data[0] for key, _ in events} == {"exited", "requester"}, events
            assert server.handle(events), "the session has not ended"
            assert server.children == {}, "the child is settled, once"
    finally:
        server._stop()
        session.kill()
        session.wait()


def test_a_child_and_its_workers_run_the_openmp_threads_and_cores_their_environment_names(
        tmp_path, monkeypatch):
    """The OpenMP runtime the server loaded with torch read the server's environment, once (here: two
    threads, no binding). An engine core forked for a replica whose environment says one thread runs one,
    and a worker it forks with vLLM's binding variables (OMP_PLACES) runs one thread on that core: before,
    both ran the server's two threads unbound, and two such engines on two cores all but stalled."""
    from .conftest import fork_server

    for name in ("OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"):  # unset (an empty OMP_PLACES binds)
        monkeypatch.delenv(name, raising=False)
    with fork_server(tmp_path, monkeypatch, "torch,tests.unit.forkserver_targets", env={"OMP_NUM_THREADS": "2"}
                     ) as (context, _, _):
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        out = tmp_path / "openmp"
        process = context.Process(target=forkserver_targets.openmp_report, kwargs={"path": str(out)})
        process.start()
        process.join(60)
        assert process.exitcode == 0
    core, worker = out.read_text().split("|")
    node = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert core == f"1 {node}", "the requester's thread count; no cores named, so all of the node's"
    assert worker == f"1 {min(os.sched_getaffinity(0))}", "the worker: bound where its variables say"
