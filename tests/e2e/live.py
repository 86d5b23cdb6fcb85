"""Helpers for the e2e tests: the shipped config, readiness polling, a live app's clients,
Prometheus scrapes, replica counts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
LOCAL_CONFIG = ROOT / "configs" / "local.yaml"
CHAT_MODEL = "smollm2-135m-instruct"
EMBED_MODEL = "all-minilm-l6-v2"
# What the e2e tests ask the chat model, expecting "Paris". SmolLM2-135M in bfloat16 is numerically
# fragile: after its default system prompt, "What is the capital of France?" alone answers Paris on
# CPUs without AMX and in float32, but drifts to "L'Étoile, la Marseillaise, ..." on CPUs whose bfloat16
# kernels use AMX. With "Answer in one sentence." every one of them answers "The capital of France is Paris."
CAPITAL_QUESTION = "What is the capital of France? Answer in one sentence."
APP_NAME = "shunter"
READY_TIMEOUT_S = 600


def assert_capital(answer: str, base_url: str, model: str = CHAT_MODEL, max_tokens: int = 30, key: str | None = None,
                   completion_prompt: str | None = None) -> None:
    """`answer` answers CAPITAL_QUESTION (or, for `completion_prompt`, completes it): it names Paris, or,
    should kernel-level drift make the tiny model answer otherwise (see CAPITAL_QUESTION), it is exactly
    the same engine's greedy answer through the platform's plainest path, asked only then. So the check
    is about the platform (this path gives what the engine answers), never about the model's knowledge."""
    assert answer and answer.strip(), "an empty answer"
    if "Paris" in answer:
        return
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if completion_prompt is None:
        resp = httpx.post(f"{base_url}/v1/chat/completions", headers=headers, timeout=120, json={
            "model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": CAPITAL_QUESTION}]})
        greedy = resp.json()["choices"][0]["message"]["content"]
    else:
        resp = httpx.post(f"{base_url}/v1/completions", headers=headers, timeout=120, json={
            "model": model, "max_tokens": max_tokens, "temperature": 0, "prompt": completion_prompt})
        greedy = resp.json()["choices"][0]["text"]
    assert answer == greedy, f"neither Paris nor the engine's own greedy answer: {answer!r} vs {greedy!r}"


def local_app_args() -> dict[str, Any]:
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    (app,) = [a for a in config["applications"] if a["name"] == APP_NAME]
    return app["args"]


def wait_ready(base_url: str, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(f"{base_url}/ready", timeout=10)
            # Until the app is deployed, Ray's proxy answers in plain text (404 for unknown routes).
            last = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else resp.text
            if resp.status_code == 200:
                return last
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.25)  # cheap to ask: a finer poll ends each wait sooner
    raise TimeoutError(f"{base_url} not ready after {timeout_s}s; last answer: {last}")


def metric_total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (Prometheus text format)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def scrape_until(url: str, wanted: list[tuple[str, dict[str, str]]], at_least: float = 1,
                 timeout_s: float = 120) -> str:
    """Scrape `url` until every (metric, labels) in `wanted` sums to `at_least`; returns the last scrape.
    Ray's metrics agent exports every few seconds, so a fresh count shows up late."""
    deadline, missing, text = time.monotonic() + timeout_s, wanted, ""
    while time.monotonic() < deadline:
        text = httpx.get(url, timeout=10).text
        missing = [(name, labels) for name, labels in wanted if metric_total(text, name, **labels) < at_least]
        if not missing:
            return text
        time.sleep(1)
    raise AssertionError(f"not exported (>= {at_least}): {missing}")


def running_replicas(app: str, deployment: str) -> int:
    """RUNNING replicas of a deployment, as `serve status` shows them."""
    from ray import serve

    status = serve.status().applications[app].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def wait_replicas(app: str, deployment: str, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if running_replicas(app, deployment) == count:
            return
        time.sleep(0.25)  # cheap to ask: a finer poll ends each wait sooner
    raise AssertionError(f"{deployment} never reached {count} running replicas: {_deployment_state(app, deployment)}")


def _deployment_state(app: str, deployment: str) -> str:
    """What a failed wait needs to say: the deployment's replicas by state, Serve's message for it, and
    the cluster's free resources (a replica that cannot be placed waits for them)."""
    import ray
    from ray import serve

    status = serve.status().applications[app].deployments[deployment]
    free = {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
    return f"{dict(status.replica_states)}, {status.status}: {status.message!r}; free resources {free}"


def ray_session_dir() -> Path:
    """The running Ray session's folder (the driver's): Ray has no public getter for it; its node object
    knows it."""
    import ray

    return Path(ray._private.worker._global_node.get_session_dir_path())


def ray_session_logs(folder: str, pattern: str) -> list[Path]:
    """Log files of the running Ray session, e.g. ("serve", "replica_app_gateway_*.log")."""
    return sorted((ray_session_dir() / "logs" / folder).glob(pattern))


def living_gateway_logs(app: str) -> set[str]:
    """The log file names of the app's gateway replicas alive now (`replica_<app>_gateway_<id>.log`): a
    replica killed or replaced earlier in the session left its log behind."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#gateway#"
    return {f"replica_{app}_gateway_{a['name'].rpartition('#')[2]}.log"
            for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def gateways_that_served(app: str, request_ids: list[str], timeout_s: float = 30) -> dict[str, str]:
    """Which gateway replica answered each request (by its X-Request-ID, which Ray Serve logs as the
    request id), from the gateway replicas' logs: request id -> log file name."""
    found: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while True:  # a replica's log handler writes a moment after the response
        for path in ray_session_logs("serve", f"replica_{app}_gateway_*.log"):
            text = path.read_text(errors="replace")
            found.update({rid: path.name for rid in request_ids if rid in text})
        if len(found) == len(request_ids) or time.monotonic() > deadline:
            return found
        time.sleep(1)


@dataclass
class LiveApp:
    base_url: str
    api_key: str = "unused"  # the clients' key, for an app with keys

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def openai(self, **kwargs: Any):
        import openai

        return openai.OpenAI(**{"base_url": self.v1, "api_key": self.api_key, "max_retries": 0, "timeout": 120, **kwargs})

    def anthropic(self, **kwargs: Any):
        import anthropic

        return anthropic.Anthropic(**{"base_url": self.base_url, "api_key": self.api_key, "max_retries": 0,
                                      "timeout": 120, **kwargs})

    def async_openai(self, **kwargs: Any):
        import openai

        return openai.AsyncOpenAI(**{"base_url": self.v1, "api_key": self.api_key, "max_retries": 0, "timeout": 300,
                                     **kwargs})

    def model_handle(self, model: str):
        from ray import serve

        from shunter.config import parse_config
        from shunter.serve_plan import deployment_name

        cfg = parse_config(local_app_args())
        return serve.get_deployment_handle(deployment_name(cfg.find_model(model)), app_name=APP_NAME)


