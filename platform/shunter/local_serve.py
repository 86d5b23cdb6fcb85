"""Small helpers for the CLI commands that serve an app on this machine (bench, demo): a free port, and
waiting until the gateway's /ready answers 200."""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base_url: str, timeout_s: float = 900) -> None:
    """Poll `base_url`/ready every 2 s until it answers 200; RuntimeError after `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/ready", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{base_url} not ready after {timeout_s:g}s")
