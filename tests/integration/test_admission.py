"""Admission control and scale from zero on a real Ray Serve app whose replicas run the FAKE engine.

- `busy` (one replica taking 2 requests at once, 2 more may queue): a burst of 8 long streams gets 4
  admitted, which all finish whole, and 4 refused at once with 429, `queue_full` and a Retry-After;
  once the burst is over, the model answers again.
- `sleepy` (autoscaling, min 0): once scaled to zero, /ready does not wake it; a request is held while
  a replica starts and is answered; when no replica can start within `cold_start_timeout_s` (the fake
  engine is told to start slowly), the request gets 503 `cold_start_timeout` with a Retry-After.
- the rejections and the autoscaler's decisions are exported as metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.live import free_port, running_replicas, scrape_until, wait_replicas
from tests.integration.local_app import local_app

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
def app(tmp_path_factory) -> Iterator[Admission]:
    control = tmp_path_factory.mktemp("faults")
    metrics_port = free_port()
    args = {"models": [
        {"name": "busy", "source": "fake:flaky", "accelerator": "cpu", "cpu_cores_per_replica": 1,
         "max_ongoing_requests": 2, "admission": {"max_queued_requests": 2}},
        {"name": "sleepy", "source": "fake:flaky", "accelerator": "cpu", "cpu_cores_per_replica": 1,
         "autoscaling": {"min_replicas": 0, "max_replicas": 1, "upscale_delay_s": 0, "downscale_delay_s": 2,
                         "cold_start_timeout_s": COLD_START_TIMEOUT_S}},
    ]}
    with local_app(args, APP, env={"SHUNTER_FAULT_DIR": str(control)}, metrics_port=metrics_port) as base:
        yield Admission(base, control, f"http://127.0.0.1:{metrics_port}/metrics")


def test_an_overload_is_refused_with_429_and_admitted_streams_finish_whole(app):
    assert app.chat("busy", "warm up")[0] == 200
    long_stream = "pace=0.2 " + "word " * 15  # about 3 s
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: app.chat("busy", long_stream, stream=True), range(8)))
    statuses = Counter(status for status, _, _ in results)
    assert statuses == {200: 4, 429: 4}, "2 running + 2 queued are admitted, the rest refused"
    for status, headers, lines in results:
        if status == 200:
            assert lines[-1] == "data: [DONE]" and len(lines) == 17, "an admitted stream is never cut"
        else:
            assert int(headers["retry-after"]) >= 1
            error = httpx.Response(429, content="".join(lines)).json()["error"]
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
            assert "busy" in error["message"]
    assert app.chat("busy", "after the burst")[0] == 200, "the model recovers once its queue drains"


def test_a_model_scaled_to_zero_is_not_woken_by_ready_and_answers_its_first_request(app):
    wait_replicas(APP, "model-sleepy", 0, timeout_s=90)
    ready = httpx.get(f"{app.base}/ready", timeout=30)
    assert ready.status_code == 200, ready.text
    assert ready.json()["models"]["sleepy"] == {"ready": True, "replicas": 0, "starts_on_demand": True}
    assert running_replicas(APP, "model-sleepy") == 0
    status, _, lines = app.chat("sleepy", "good morning")
    assert status == 200, lines
    assert "good morning" in "".join(lines)


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
        ("ray_shunter_rejections_total", {"model": "busy", "reason": "queue_full"}),
        ("ray_shunter_rejections_total", {"model": "sleepy", "reason": "cold_start_timeout"}),
    ])
    text = scrape_until(app.metrics_url, [("ray_shunter_autoscaling_desired_replicas", {"model": "sleepy"})])
    assert 'ray_shunter_queue_depth{' in text and 'ray_shunter_autoscaling_running_replicas{' in text
