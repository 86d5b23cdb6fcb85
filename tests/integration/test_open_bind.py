"""A gateway with no API keys refuses to start on an address other machines reach, unless the config
says `auth.anonymous: true` (behind an authenticating proxy). Anyone reaching an open gateway could use
every model and every /admin action. Real Ray Serve; the FAKE engine stands in for the model, which plays
no part in the refusal. Both tests share one cluster bound to every interface (`keep_cluster`: one start
instead of two); the next `own_cluster` module stops it."""

from __future__ import annotations

import ipaddress
import socket
import time
from urllib.parse import urlparse

import httpx
import psutil
import pytest

from tests.integration.local_app import local_app

pytestmark = pytest.mark.own_cluster

ARGS = {"models": [{"name": "m", "source": "fake:flaky", "accelerator": "cpu", "cpu_cores_per_replica": 1}],
        "gateway": {"queue_timeout_s": 20}}


WILDCARDS = {"0.0.0.0", "::"}  # every interface: reachable from other machines


def _listening_on(port: int) -> set[str]:
    """The addresses sockets on this machine listen on at `port` (Linux shows every process's sockets)."""
    return {c.laddr.ip for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def _public_address() -> str | None:
    """An IPv4 address of this machine that is not loopback, if it has one."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    return None


def test_a_keyless_gateway_refuses_to_start_on_a_public_address():
    from ray import serve

    with local_app(ARGS, "open", host="0.0.0.0", blocking=False, keep_cluster=True) as base:
        deadline, message = time.monotonic() + 120, ""
        while time.monotonic() < deadline and "no API keys on 0.0.0.0" not in message:
            time.sleep(1)
            app = serve.status().applications.get("open")
            gateway = app.deployments.get("gateway") if app else None
            message = gateway.message if gateway else ""
        assert "no API keys on 0.0.0.0" in message and "auth.anonymous: true" in message, message
        # The refusal is about a real public bind: Serve's HTTP port listens on every interface.
        listening = _listening_on(urlparse(base).port)
        assert listening and listening <= WILDCARDS, listening


def test_a_keyless_gateway_starts_on_a_public_address_when_the_config_says_anonymous():
    with local_app({**ARGS, "auth": {"anonymous": True}}, "anonymous", host="0.0.0.0", keep_cluster=True) as base:
        port = urlparse(base).port
        listening = _listening_on(port)
        assert listening and listening <= WILDCARDS, f"the port listens on {listening}, not every interface"
        public = _public_address()
        # Through an interface other machines reach, when this one has one; else through loopback.
        url = f"http://{public}:{port}" if public else base
        resp = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                          json={"model": "m", "messages": [{"role": "user", "content": "hello"}]})
        assert resp.status_code == 200, resp.text
