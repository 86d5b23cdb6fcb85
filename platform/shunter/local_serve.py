"""Serving an app on this machine for a CLI command that measures or shows it (bench, demo): one local
Ray cluster with Serve on a free port, apps deployed on it and waited for, everything stopped at the end.
`shunter serve` is not one of these: it is the foreground server, with its own graceful Ctrl-C; it shares
`local_cluster_env`, what any Ray cluster started on this machine needs for direct ingress."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from shunter.cluster_quiet import quiet_env
from shunter.ingress import HA_PROXY, direct_ingress_env, direct_ingress_wanted, haproxy_without_splice
from shunter.ray_compat import init_metrics_port

# Ray's default 30 s; it also raises an ingress deployment's graceful_shutdown_timeout_s to 35 s.
MIN_DRAINING = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
LOCAL_MIN_DRAINING_S = 2  # one machine, HAProxy reloaded within 0.1 s: no outside balancer to wait for
# The folder of a cluster's direct-ingress files (local_cluster_env): each cluster started here has its own.
HAPROXY_FOLDER = "RAY_SERVE_HAPROXY_SERVER_STATE_BASE"


# Ray's worker processes listen on ports 10002-19999 (`ray start --min/max-worker-port` defaults).
_RAY_WORKER_PORTS_END = 20000


def free_port() -> int:
    """A port nothing listens on now, and that nothing else on this machine will draw before its user
    binds it, seconds later. A port from bind(0) comes from the kernel's ephemeral range, where every
    outgoing connection and each of a starting Ray cluster's own bind(0) calls draw theirs: CI once
    saw a cluster's HAProxy fail to start, its metrics port taken in between. So the port is drawn at
    random between Ray's worker ports and the ephemeral range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_start = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_start = 32768  # Linux's default
    for _ in range(100 if ephemeral_start - _RAY_WORKER_PORTS_END > 100 else 0):
        port = random.randrange(_RAY_WORKER_PORTS_END, ephemeral_start)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # noqa: S104 - a probe, closed at once; HAProxy binds every address
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room outside the ephemeral range on this machine
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_cluster_env(direct: bool | None = None) -> dict[str, str]:
    """What a Ray cluster started on this machine (`ray.init` here, or `ray start` by a test) needs for
    direct ingress (`direct`; None: `shunter.ingress.direct_ingress_wanted()`), or to go without it.
    `os.environ.update(local_cluster_env())` before `ray.init` gives it to every process of the cluster.

    Ray's HAProxy keeps its files under /tmp/haproxy-serve and its stats and metrics on ports 8404 and
    9101 by default, so two clusters on one machine (a test run beside `shunter serve`, or a cluster
    starting while the last one's HAProxy is still stopping) would share them: each cluster gets its
    own folder and free ports. An ingress replica told to stop keeps serving for
    `RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S` so that balancers in front of the HAProxy can take
    it out (Ray's default 30 s); with nothing in front of a one-machine cluster it is 2 s unless set.
    HAProxy runs without kernel splicing, so that a client's close reaches the gateway (shunter.ingress).
    Either way, Ray Serve's periodic work runs at Shunter's slower pace (shunter.cluster_quiet)."""
    if not (direct_ingress_wanted() if direct is None else direct):
        return {HA_PROXY: "0", **quiet_env()}
    folder = tempfile.mkdtemp(prefix="shunter-haproxy-")
    return {
        **quiet_env(),  # Ray Serve's periodic work slowed to what serving needs (shunter.cluster_quiet)
        **direct_ingress_env(),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(folder, "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(folder, "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": folder,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(folder, "server-state"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        MIN_DRAINING: os.environ.get(MIN_DRAINING, str(LOCAL_MIN_DRAINING_S)),
        **haproxy_without_splice(folder),  # so that a client's close reaches the gateway (shunter.ingress)
    }


def reap_haproxy(folder: str | None, timeout_s: float = 5.0) -> list[int]:
    """Stop the HAProxy processes of the cluster whose direct-ingress files are in `folder` (its
    HAPROXY_FOLDER), once that cluster is down; returns their pids.

    Why: deleting applications makes Serve's proxy reload HAProxy, which starts a new process, and a proxy
    actor killed by the cluster's shutdown right after never stops that one: it stayed, parent 1, holding its
    ports, after each full test run (docs/design.md, the suite's time). Only a process whose arguments name a
    file in this cluster's own folder is stopped, so another cluster's HAProxy on the machine is left alone."""
    if not folder:
        return []
    import psutil

    inside = os.path.join(os.path.realpath(folder), "")
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if cmd and os.path.basename(cmd[0]) == "haproxy" and \
                any(arg.startswith("/") and os.path.realpath(arg).startswith(inside) for arg in cmd[1:]):
            found.append(proc)
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(found, timeout=timeout_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return [proc.pid for proc in found]


def wait_ready(base_url: str, timeout_s: float = 900, path: str = "/ready") -> None:
    """Poll `base_url` + `path` every 2 s until it answers 200; RuntimeError after `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}{path}", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{base_url} not ready after {timeout_s:g}s")


@dataclass
class LocalServe:
    base_url: str  # Serve's HTTP proxy
    metrics_url: str | None  # Ray's metrics exporter, when asked for

    def deploy(self, app: Any, name: str, timeout_s: float = 900, ready_path: str = "/ready") -> None:
        """Run `app` (a bound Serve application) as `name` at `/`, replacing any app of that name, and wait
        until it answers 200 on `ready_path` (a Shunter gateway's /ready; another app's own probe)."""
        from ray import serve

        serve.run(app, name=name, route_prefix="/")
        wait_ready(self.base_url, timeout_s, ready_path)


@contextmanager
def local_serve(metrics: bool = False, direct_ingress: bool | None = None) -> Iterator[LocalServe]:
    """A Ray cluster and Serve in this process for the block; `metrics` exports Ray's metrics on a known
    port (`metrics_url`); `direct_ingress`: see `local_cluster_env` (a peer is measured as users run it,
    behind Ray's proxy). Serve and Ray are shut down however the block ends, and this process's
    environment is given back."""
    import ray
    from ray import serve

    metrics_port = free_port() if metrics else None
    env = local_cluster_env(direct_ingress)
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # the processes Ray starts inherit it
    # ray.init has no public way to choose the exporter's port, and a scraper started before the cluster
    # must know it (shunter.ray_compat.init_metrics_port).
    try:
        ray.init(include_dashboard=False, log_to_driver=False, **init_metrics_port(metrics_port))
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield LocalServe(f"http://127.0.0.1:{port}",
                         f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None)
    finally:
        serve.shutdown()
        ray.shutdown()
        reap_haproxy(env.get(HAPROXY_FOLDER))
