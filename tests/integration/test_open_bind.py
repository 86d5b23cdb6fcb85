"""A gateway with no API keys refuses to start on an address other machines reach, unless the config
says `auth.anonymous: true` (behind an authenticating proxy). Anyone reaching an open gateway could use
every model and every /admin action. Real Ray Serve; the FAKE engine stands in for the model, which plays
no part in the refusal."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.local_app import local_app

pytestmark = pytest.mark.own_cluster

ARGS = {"models": [{"name": "m", "source": "fake:flaky", "accelerator": "cpu", "cpu_cores_per_replica": 1}],
        "gateway": {"queue_timeout_s": 20}}


def test_a_keyless_gateway_refuses_to_start_on_a_public_address():
    from ray import serve

    with local_app(ARGS, "open", host="0.0.0.0", blocking=False):
        deadline, message = time.monotonic() + 120, ""
        while time.monotonic() < deadline and "no API keys on 0.0.0.0" not in message:
            time.sleep(1)
            app = serve.status().applications.get("open")
            gateway = app.deployments.get("gateway") if app else None
            message = gateway.message if gateway else ""
        assert "no API keys on 0.0.0.0" in message and "auth.anonymous: true" in message, message


def test_a_keyless_gateway_starts_on_a_public_address_when_the_config_says_anonymous():
    with local_app({**ARGS, "auth": {"anonymous": True}}, "anonymous", host="0.0.0.0") as base:
        resp = httpx.post(f"{base}/v1/chat/completions", timeout=30,
                          json={"model": "m", "messages": [{"role": "user", "content": "hello"}]})
        assert resp.status_code == 200, resp.text
