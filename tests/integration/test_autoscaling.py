"""Queue-depth autoscaling on a real Ray Serve app whose replicas run the FAKE engine.

The fake engine counts its open streams as its engine queue (what a vLLM replica reports as waiting +
running requests). A burst of concurrent streams makes the model scale from 1 to 2 replicas; when the
burst ends it goes back to 1, and every stream of the burst ends complete, across both changes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.live import running_replicas, wait_replicas
from tests.integration.local_app import local_app

APP, DEPLOYMENT = "autoscaled", "model-elastic"


@pytest.fixture(scope="module")
def elastic() -> Iterator[str]:
    args = {"models": [{
        "name": "elastic", "source": "fake:flaky", "accelerator": "cpu", "cpu_cores_per_replica": 1,
        "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_queue_per_replica": 2,
                        "upscale_delay_s": 2, "downscale_delay_s": 5},
    }]}
    with local_app(args, APP) as base:
        yield base


def test_a_burst_scales_up_and_back_down_without_losing_a_stream(elastic):
    assert running_replicas(APP, DEPLOYMENT) == 1
    stop = threading.Event()
    outcomes: list[str] = []

    def stream_until_stopped() -> None:
        while not stop.is_set():
            with httpx.stream("POST", f"{elastic}/v1/chat/completions", timeout=60, json={
                    "model": "elastic", "stream": True,
                    "messages": [{"role": "user", "content": " ".join(["w"] * 40)}]}) as resp:
                lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
            outcomes.append("ok" if resp.status_code == 200 and lines[-1] == "data: [DONE]" else
                            f"{resp.status_code}: {lines[-1:]}")

    threads = [threading.Thread(target=stream_until_stopped) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        wait_replicas(APP, DEPLOYMENT, 2, timeout_s=90)
    finally:
        stop.set()
        for t in threads:
            t.join()
    wait_replicas(APP, DEPLOYMENT, 1, timeout_s=120)
    assert outcomes and set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"][:5]
