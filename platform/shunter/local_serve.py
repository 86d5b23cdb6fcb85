"""Serving an app on this machine for a CLI command that measures or shows it (bench, demo): one local
Ray cluster with Serve on a free port, apps deployed on it and waited for, everything stopped at the end.
`shunter serve` is not one of these: it is the foreground server, with its own graceful Ctrl-C."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
def local_serve(metrics: bool = False) -> Iterator[LocalServe]:
    """A Ray cluster and Serve in this process for the block; `metrics` exports Ray's metrics on a known
    port (`metrics_url`). Serve and Ray are shut down however the block ends."""
    import ray
    from ray import serve

    metrics_port = free_port() if metrics else None
    # _metrics_export_port: ray.init has no public way to choose the exporter's port, and a scraper
    # started before the cluster must know it.
    ray.init(include_dashboard=False, log_to_driver=False,
             **({"_metrics_export_port": metrics_port} if metrics_port else {}))
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield LocalServe(f"http://127.0.0.1:{port}",
                         f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None)
    finally:
        serve.shutdown()
        ray.shutdown()
