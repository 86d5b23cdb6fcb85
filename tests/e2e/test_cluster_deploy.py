"""The cluster path of the README: `ray start --head`, `serve deploy configs/local.yaml`, `serve status`.

The cluster gets its own ports and temp dir, so it can be told apart from any other Ray on the machine,
and only its processes are stopped afterwards (`ray stop` would stop every Ray cluster of the user).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from shunter.local_serve import HAPROXY_FOLDER, free_port, local_cluster_env, reap_haproxy

from .live import CAPITAL_QUESTION, CHAT_MODEL, LOCAL_CONFIG, assert_capital, wait_ready

BIN = Path(sys.executable).parent


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def _stop_cluster(temp_dir: str) -> None:
    """SIGTERM, then SIGKILL, every process whose command line names this cluster's temp dir."""
    def ours() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if any(temp_dir in part for part in proc.info["cmdline"] or []):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = ours()
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=20)
    # Workers (replicas, engine cores) die with their raylet; give them a moment.
    deadline = time.monotonic() + 30
    while ours() and time.monotonic() < deadline:
        time.sleep(1)


def _app_status(address: str, env: dict[str, str], settle_s: float = 180) -> dict:
    """The app's entry in `serve status` once it leaves DEPLOYING (or the last one seen)."""
    deadline = time.monotonic() + settle_s
    while True:
        status = _run([str(BIN / "serve"), "status", "--address", address], env, timeout=60)
        assert status.returncode == 0, status.stderr
        app = yaml.safe_load(status.stdout)["applications"]["shunter"]
        if app["status"] != "DEPLOYING" or time.monotonic() > deadline:
            return app
        time.sleep(1)


@pytest.mark.own_cluster
def test_ray_start_then_serve_deploy_local_config(exclusive_machine, tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="shunter-e2e-", dir="/tmp")  # short: Ray's socket paths are length-limited
    gcs_port, dashboard_port, http_port = free_port(), free_port(), free_port()
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    config["http_options"]["port"] = http_port  # the shipped config, on a port no one else uses
    deploy_file = tmp_path / "local.yaml"
    deploy_file.write_text(yaml.safe_dump(config))
    # `ray start` turns token auth on; the CLI must follow. Direct ingress as the README's
    # `RAY_SERVE_ENABLE_HA_PROXY=1 ray start --head`, with this cluster's own HAProxy files and ports.
    env = {**os.environ, **local_cluster_env(), "RAY_AUTH_MODE": "token"}
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        started = _run([str(BIN / "ray"), "start", "--head", f"--port={gcs_port}", "--num-cpus=2",
                        f"--dashboard-port={dashboard_port}", "--dashboard-host=127.0.0.1",
                        f"--ray-client-server-port={free_port()}", f"--temp-dir={temp_dir}",
                        "--disable-usage-stats"], env)
        assert started.returncode == 0, started.stdout + started.stderr

        deployed = _run([str(BIN / "serve"), "deploy", str(deploy_file), "--address", address], env)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr

        base_url = f"http://127.0.0.1:{http_port}"
        wait_ready(base_url)
        # `/ready` answers from the replicas; `serve status` from the controller's own reconcile loop,
        # which can report DEPLOYING for a while after the replicas answer (CI saw it once). The app
        # must reach RUNNING; how soon is the controller's business, so poll until it says so.
        app = _app_status(address, env)
        assert app["status"] == "RUNNING", app

        resp = httpx.post(f"{base_url}/v1/chat/completions", timeout=120, json={
            "model": CHAT_MODEL, "max_tokens": 30, "temperature": 0,
            "messages": [{"role": "user", "content": CAPITAL_QUESTION}]})
        assert resp.status_code == 200, resp.text
        assert_capital(resp.json()["choices"][0]["message"]["content"], base_url)
    finally:
        _stop_cluster(temp_dir)
        # HAProxy's command line names its own folder, not the cluster's temp dir: one a reload started
        # outlived the cluster (parent 1) after a CI-like run.
        reap_haproxy(env.get(HAPROXY_FOLDER))
        shutil.rmtree(temp_dir, ignore_errors=True)
