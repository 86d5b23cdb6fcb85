"""Fixtures the unit modules share."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def wait_until(predicate: Callable[[], object], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A real S3 endpoint on localhost (moto's server), for the object-store modules' tests."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@contextlib.contextmanager
def fork_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preload: str,
                env: dict[str, str] | None = None) -> Iterator[tuple]:
    """A node's engine fork server (shunter.engine_forkserver) bound to a session process of the test's own
    (a sleeper), preloading `preload` (comma-separated modules), its environment this one's plus `env`:
    (its fork context, the session, the server)."""
    from shunter import engine_forkserver
    from shunter.engine_forkserver import ForkContext, ready_marker, server_address

    monkeypatch.setattr(engine_forkserver.tempfile, "gettempdir", lambda: str(tmp_path))
    session = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    address = server_address(session.pid)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "shunter.engine_forkserver", str(address), str(session.pid),
                             preload], cwd=ROOT, env=env)
    try:
        wait_until(ready_marker(address).exists)
        yield ForkContext(address), session, proc
    finally:
        proc.terminate()  # the server ends what it forked
        session.kill()
        for p in (proc, session):
            p.wait()


@pytest.fixture()
def server(tmp_path, monkeypatch):
    """A fork server preloading only `json` and the tests' targets (no vLLM)."""
    with fork_server(tmp_path, monkeypatch, "json,tests.unit.forkserver_targets") as made:
        yield made
