"""A cold start slower than its timeout, on a real Ray Serve app whose replica runs the FAKE engine (told
to start slowly: a fault a real engine cannot show on demand).

`sleepy` (autoscaling, min 0): once scaled to zero, a request that no replica can take within
`cold_start_timeout_s` gets 503 `cold_start_timeout` with a Retry-After, and the rejection and the
autoscaler's decisions are exported as metrics. Overload (429 queue_full) and scale from zero with a real
engine are tests/e2e/test_autoscaling.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.live import scrape_until, wait_replicas
from tests.integration.local_app import fault_dir, kept_metrics_url, local_app

APP = "admission"
COLD_START_TIMEOUT_S = 15


@dataclass
class Admission:
    base: str
    control: Path
    metrics_url: str

    def chat(self, model: str, content: str, stream: bool = False) -> tuple[int, dict[str, str], list[str]]:
        """Status, headers, and the SSE data lines of a streamed 200 (the body's lines otherwise)."""
        with httpx.stream("POST", f"{self.base}/v1/chat/completions", timeout=120, json={
                "model": model, "stream": stream, "messages": [{"role": "user", "content": content}]}) as resp:
            lines = list(resp.iter_lines())
        if stream and resp.status_code == 200:
            lines = [line for line in lines if line.startswith("data: ")]
        return resp.status_code, dict(resp.headers), lines


@pytest.fixture(scope="module")
def app() -> Iterator[Admission]:
    args = {"models": [
        {"name": "sleepy", "source": "fake:flaky", "accelerator": "cpu", "cpu_cores_per_replica": 1,
         "autoscaling": {"min_replicas": 0, "max_replicas": 1, "upscale_delay_s": 0, "downscale_delay_s": 2,
                         "cold_start_timeout_s": COLD_START_TIMEOUT_S}},
    ]}
    with local_app(args, APP, keep_cluster=True) as base:
        yield Admission(base, fault_dir(), kept_metrics_url())


def test_a_cold_start_slower_than_its_timeout_is_a_503_with_retry_after(app):
    wait_replicas(APP, "model-sleepy", 0, timeout_s=90)
    (app.control / "start-delay").write_text("600")
    try:
        status, headers, lines = app.chat("sleepy", "anyone there")
    finally:
        (app.control / "start-delay").unlink()
    assert status == 503 and int(headers["retry-after"]) >= 1
    error = httpx.Response(503, content="".join(lines)).json()["error"]
    assert error["code"] == "cold_start_timeout" and f"{COLD_START_TIMEOUT_S}s" in error["message"]


def test_rejections_and_scaling_decisions_are_exported(app):
    scrape_until(app.metrics_url, [
        ("ray_shunter_rejections_total", {"model": "sleepy", "reason": "cold_start_timeout"}),
    ])
    text = scrape_until(app.metrics_url, [("ray_shunter_autoscaling_desired_replicas", {"model": "sleepy"})])
    assert 'ray_shunter_queue_depth{' in text and 'ray_shunter_autoscaling_running_replicas{' in text
