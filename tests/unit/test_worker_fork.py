"""A model replica's Ray worker forked from the node's server (shunter.worker_fork), with a stand-in for
Ray's worker script: the launcher Ray starts stays in the worker's place (exit status, signals, its death
ends the worker), the worker runs with the launcher's arguments, environment and working directory, and a
launcher with no server to reach starts the worker cold. That Ray accepts such a worker is shown by every
e2e module: their CPU model replicas start this way (shunter.serve_plan sets the launcher)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from .conftest import ROOT, fork_server, wait_until

# Stands in for Ray's default_worker.py: reports what it runs with, then exits with argv[2] or sleeps.
WORKER = """\
import json, logging, os, sys, time
report = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(),
          "env": os.environ.get("WORKER_TEST"), "preloaded": "tests.unit.forkserver_targets" in sys.modules,
          "path0": sys.path[0], "root_handlers": len(logging.root.handlers)}
with open(sys.argv[1] + ".part", "w") as f:
    json.dump(report, f)
os.replace(sys.argv[1] + ".part", sys.argv[1])
if sys.argv[2] == "sleep":
    time.sleep(600)
sys.exit(int(sys.argv[2]))
"""


def _launch(server, tmp_path: Path, mode: str, **env: str) -> tuple[subprocess.Popen, Path]:
    context, session, _ = server
    script, report = tmp_path / "worker" / "default_worker.py", tmp_path / "report.json"
    script.parent.mkdir(exist_ok=True)
    script.write_text(WORKER)
    workdir = tmp_path / "cwd"
    workdir.mkdir(exist_ok=True)
    environment = {**os.environ, "TMPDIR": str(tmp_path), "RAY_RAYLET_PID": str(session.pid),
                   "WORKER_TEST": "the-launchers", "PYTHONPATH": str(ROOT / "platform"), **env}
    launcher = subprocess.Popen([sys.executable, "-m", "shunter.worker_fork", str(script), str(report), mode],
                                cwd=workdir, env=environment)
    wait_until(report.exists)
    return launcher, report


def _report(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


def test_the_worker_is_the_servers_child_with_the_launchers_arguments_and_exits_as_the_launcher(server, tmp_path):
    _, _, server_process = server
    launcher, report_path = _launch(server, tmp_path, "7")
    assert launcher.wait(timeout=30) == 7, "the launcher exits with the worker's status"
    report = _report(report_path)
    assert report["ppid"] == server_process.pid and report["pid"] != launcher.pid, "forked, not run cold"
    assert report["preloaded"], "the server's imports are the worker's"
    assert report["argv"] == [str(tmp_path / "worker" / "default_worker.py"), str(report_path), "7"]
    assert report["cwd"] == str(tmp_path / "cwd") and report["env"] == "the-launchers"
    assert report["path0"] == str(tmp_path / "worker"), "the script's directory first, as `python SCRIPT` has"
    assert report["root_handlers"] == 0, "the server's logging setup is not the worker's"


def test_a_signal_to_the_launcher_reaches_the_worker_and_the_launcher_ends_by_it(server, tmp_path):
    launcher, report_path = _launch(server, tmp_path, "sleep")
    worker = psutil.Process(_report(report_path)["pid"])
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == -signal.SIGTERM
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE


def test_a_launcher_killed_outright_takes_its_worker_with_it(server, tmp_path):
    launcher, report_path = _launch(server, tmp_path, "sleep")
    worker = psutil.Process(_report(report_path)["pid"])
    launcher.kill()  # as the raylet kills a worker process it gave up on
    launcher.wait()
    wait_until(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE)


def test_with_no_server_to_reach_the_worker_starts_cold(server, tmp_path):
    # The socket directory is not this user's alone: no server may be started or used there.
    (tmp_path / f"shunter-forkserver-{os.getuid()}").chmod(0o755)
    launcher, report_path = _launch(server, tmp_path, "3")
    assert launcher.wait(timeout=60) == 3
    report = _report(report_path)
    assert report["pid"] == launcher.pid and not report["preloaded"], "exec'd in the launcher's place"
    assert report["env"] == "the-launchers" and report["cwd"] == str(tmp_path / "cwd")


def test_the_servers_imports_keep_ray_out_so_a_child_configures_ray_from_its_own_environment(tmp_path, monkeypatch):
    from shunter.engine_forkserver import ForkContext

    from . import forkserver_targets

    with fork_server(tmp_path, monkeypatch, "tests.unit.forkserver_ray_probe,tests.unit.forkserver_targets") as made:
        monkeypatch.setenv("RAY_maximum_gcs_destroyed_actor_cached_count", "123")
        child = ForkContext(made[0].address).Process(target=forkserver_targets.ray_probe,
                                                     kwargs={"path": str(tmp_path / "r")})
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert (tmp_path / "r").read_text() == "True|123", "ray imported afresh in the child, from its environment"
