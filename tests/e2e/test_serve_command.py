"""`make serve` (`shunter serve FILE`) stopped with Ctrl-C, as a terminal sends it: SIGINT to the whole
foreground process group, here while a stream is running.

The stream must run to its end (Ray's own `serve run` kills the HTTP proxy on Ctrl-C and cuts it), and the
command must then stop by itself, long before the model's drain timeout: an idle server does not wait
for a drain it does not need.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from shunter.local_serve import free_port

from .live import CHAT_MODEL, LOCAL_CONFIG, wait_ready

SHUNTER = Path(sys.executable).parent / "shunter"
DRAIN_TIMEOUT_S = 120  # far above what the stream needs, so stopping early shows the drain ended when idle
STREAM_TOKENS = 200


def _one_model_config(port: int) -> dict:
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args["models"] = [m for m in args["models"] if m["name"] == CHAT_MODEL]
    args["models"][0]["draining"] = {"timeout_s": DRAIN_TIMEOUT_S}
    return config


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _default_sigint() -> None:
    # As from a terminal: a shell starting a background job would otherwise have SIGINT ignored.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.own_cluster
@pytest.mark.timeout(600)
def test_ctrl_c_lets_a_running_stream_finish_then_stops(exclusive_machine, tmp_path):
    port = free_port()
    config_file = tmp_path / "one-model.yaml"
    config_file.write_text(yaml.safe_dump(_one_model_config(port)))
    ray_tmp = tempfile.mkdtemp(prefix="shunter-serve-", dir="/tmp")  # short: Ray's socket paths are length-limited
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([str(SHUNTER), "serve", str(config_file)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "RAY_TMPDIR": ray_tmp}, start_new_session=True,
                            preexec_fn=_default_sigint)
    tree: list[psutil.Process] = []
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        tree = psutil.Process(proc.pid).children(recursive=True)
        commands = {process.pid: " ".join(_cmdline(process)) for process in tree}
        events, interrupted_at = [], None
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=120, json={
                "model": CHAT_MODEL, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "Tell me a long story."}]}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 3:
                    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, mid-stream
                    interrupted_at = time.monotonic()
        assert interrupted_at is not None, f"the stream ended before Ctrl-C could be sent: {events}"
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c], "the stream was cut by the shutdown"
        assert chunks[-1]["usage"]["completion_tokens"] == STREAM_TOKENS, "every token reached the client"
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"

        rc = proc.wait(timeout=DRAIN_TIMEOUT_S / 2)  # TimeoutExpired: it waited for the drain timeout
        assert rc == 0, (tmp_path / "serve.log").read_text()[-3000:]
        out = (tmp_path / "serve.log").read_text()
        assert "draining:" in out and "drained in" in out
        # Stopped means stopped: no process it started lives on (HAProxy included: Ray runs it as a child of
        # its proxy actor), and the port can be served again.
        assert [c for c in commands.values() if "haproxy" in c], f"no HAProxy serving {base}: {commands}"
        deadline = time.monotonic() + 30
        while [p for p in tree if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not [p for p in tree if _alive(p)], [commands[p.pid][:200] for p in tree if _alive(p)]
        listening = [c for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and
                     c.status == psutil.CONN_LISTEN]
        assert not listening, f"port {port} is still served: {listening}"
        with socket.socket() as probe:  # as a server started next would bind it (TIME_WAIT is no obstacle)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for child in tree:  # Ray's processes, had the command not stopped them
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
