"""Observability of a live app with real engines: one trace per request across processes, structured logs
that carry the request and trace ids, and every metric the shipped dashboards query really exported.

The app serves SmolLM2 as version v1 (a real engine), v2 (a second real engine, started later), and a
version `broken` run by the FAKE fault-injecting engine (tests/integration/fault_engine.py: every
request answers 500), because errors, failovers, breakers and a rolled-back rollout are what several
panels show and a real engine cannot fail on demand. Spans go through OpenTelemetry's real OTLP/HTTP
exporter to a receiver in this test (tests/otlp_receiver.py). A real Prometheus scrapes Ray's metrics
exporter for the whole module, and the last test sends every dashboard expression to it. The tests run in
order on one app.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shunter.cli.demo.prometheus import Prometheus, has_data
from shunter.local_serve import free_port
from tests.e2e.live import wait_ready
from tests.integration.local_app import local_app
from tests.otlp_receiver import OTLPReceiver
from tests.rollout_client import start_rollout, wait_done

pytestmark = pytest.mark.own_cluster

APP = "observability"
MODEL = "smol"
SMOL = "builtin:smollm2-135m-instruct"
SCRAPE_S = 2.0
SYSTEM = " ".join(f"Fact {i}: depot {i} ships crates to harbour {i % 7} every morning." for i in range(40))


ADAPTERS = ("obs-a", "obs-b")  # two LoRA adapters of the model, one held at a time (max_cpu_loras 1)


def _args(otlp_endpoint: str, adapters: dict[str, str]) -> dict:
    return {
        "models": [{
            "name": MODEL,
            "engine": {"max_model_len": 2048, "max_num_seqs": 8, "cpu_kv_cache_gib": 1, "max_loras": 1,
                       "max_cpu_loras": 1, "max_lora_rank": 8},
            "adapters": [{"name": name, "source": path} for name, path in adapters.items()],
            "versions": [{"name": "v1", "source": SMOL, "weight": 100}, {"name": "v2", "source": SMOL},
                         {"name": "broken", "source": "fake:broken"}],
            "max_ongoing_requests": 4,
            # The usage ledger's cost (the flow dashboard's cost panel).
            "pricing": {"input_per_million": 0.5, "output_per_million": 2.0},
            "admission": {"max_queued_requests": 0},
            "rollout": {"steps": [10, 100], "hold_s": 2, "max_hold_s": 60, "ready_timeout_s": 300,
                        "gates": {"min_requests": 3}},
            "draining": {"timeout_s": 3},
        }],
        "observability": {"tracing": {"exporter": "otlp", "otlp_endpoint": otlp_endpoint},
                          "logging": {"format": "json"}},
    }


class Live:
    def __init__(self, base: str, metrics_url: str, spans: OTLPReceiver, prometheus: Prometheus):
        self.base, self.metrics_url, self.spans, self.prometheus = base, metrics_url, spans, prometheus
        self.started_at = time.time()

    def chat(self, content: str, **extra) -> httpx.Response:
        return httpx.post(f"{self.base}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra})


@pytest.fixture(scope="module")
def live(exclusive_machine, tmp_path_factory) -> Iterator[Live]:
    from shunter.bench.lora_adapters import make_adapter
    from shunter.catalog import resolve_source

    folder, base_dir = tmp_path_factory.mktemp("adapters"), resolve_source(SMOL, progress=False)
    adapters = {name: make_adapter(base_dir, folder / name, seed=i + 1) for i, name in enumerate(ADAPTERS)}
    metrics_port = free_port()
    with OTLPReceiver() as receiver, \
            local_app(_args(receiver.endpoint, adapters), APP, metrics_port=metrics_port) as base, \
            Prometheus([f"127.0.0.1:{metrics_port}"], scrape_interval_s=SCRAPE_S) as prometheus:
        wait_ready(base)
        prometheus.wait_scraped()
        yield Live(base, f"http://127.0.0.1:{metrics_port}/metrics", receiver, prometheus)


def test_one_request_is_one_trace_from_the_client_through_the_replica_to_the_engine(live):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with httpx.stream("POST", f"{live.base}/v1/chat/completions", timeout=120,
                      headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
                      json={"model": MODEL, "stream": True, "max_tokens": 8,
                            "messages": [{"role": "user", "content": "Name a colour."}]}) as resp:
        body = "".join(resp.iter_text())
        request_id = resp.headers["x-request-id"]
    assert resp.status_code == 200 and "data: [DONE]" in body
    assert '"usage"' not in body, "the usage chunk the gateway asked for is not passed to a client that did not"

    names = {"chat smol", "route", "replica chat", "engine.generate"}
    deadline = time.monotonic() + 30
    while {s.name for s in live.spans.trace(trace_id)} < names and time.monotonic() < deadline:
        time.sleep(0.5)
    spans = {s.name: s for s in live.spans.trace(trace_id)}
    assert set(spans) >= names, f"spans of the client's trace: {sorted(spans)}"
    gateway, route, replica, engine = (spans[n] for n in ("chat smol", "route", "replica chat", "engine.generate"))
    assert gateway.parent_span_id == client_span, "the gateway's span continues the client's traceparent"
    assert route.parent_span_id == gateway.span_id and replica.parent_span_id == route.span_id
    assert engine.parent_span_id == replica.span_id and "first_token" in engine.events
    assert gateway.component == "gateway" and replica.component == "model_server", "two processes, one trace"
    assert gateway.attributes["shunter.request_id"] == request_id
    assert gateway.attributes["shunter.version"] == "v1" and gateway.attributes["gen_ai.usage.output_tokens"] > 0
    assert route.attributes["shunter.replica"] == replica.attributes["shunter.replica"]


def _ask_adapters(live: Live, round_: int) -> None:
    for name in ADAPTERS:
        resp = httpx.post(f"{live.base}/v1/chat/completions", timeout=120, json={
            "model": name, "max_tokens": 4, "messages": [{"role": "user", "content": f"Round {round_}."}]})
        assert resp.status_code == 200 and resp.json()["model"] == name, resp.text


def test_requests_to_lora_adapters_are_served_each_loaded_in_turn(live):
    """Two adapters on a replica that holds one: each is loaded, then evicted by the other. The next test
    but one asks again, long enough after (the replica exports every few seconds) that the adapter
    panels' rates have a baseline to rise from."""
    _ask_adapters(live, 0)


def test_a_rollout_to_a_failing_version_is_rolled_back_with_no_client_error(live):
    # A long shared system prompt on v1 as well, so the engine's prefix cache counts hits.
    for q in range(2):
        assert httpx.post(f"{live.base}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "max_tokens": 4, "messages": [
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {q}?"}]}
        ).status_code == 200
    start_rollout(live.base, MODEL, "broken")
    answers, deadline = [], time.monotonic() + 240
    while (status := httpx.get(f"{live.base}/admin/rollouts/{MODEL}", timeout=30).json())["rollout"]["phase"] \
            not in ("rolling_back", "done"):
        assert time.monotonic() < deadline, f"the gates never judged the broken version: {status['rollout']}"
        answers.append(live.chat(f"hello {len(answers)}", user=f"user-{len(answers)}").status_code)
    assert answers, "the rollout was judged before any request was sent"
    status = wait_done(live.base, MODEL)
    assert status["rollout"]["outcome"] == "rolled_back", status["rollout"]["history"][-2]["reason"]
    assert set(answers) == {200}, "a failed first attempt on the bad version was served by v1"


def test_requests_to_lora_adapters_carry_the_adapter_in_spans(live):
    _ask_adapters(live, 1)  # each adapter loaded again: its load counter rises
    asked = sorted(ADAPTERS * 2)
    deadline, spans = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        spans = [s for s in live.spans.all() if s.name == f"chat {MODEL}" and "shunter.adapter" in s.attributes]
        if len(spans) >= len(asked):
            break
        time.sleep(0.5)
    assert sorted(s.attributes["shunter.adapter"] for s in spans) == asked, spans
    assert all(s.attributes["gen_ai.request.model"] == s.attributes["shunter.adapter"] for s in spans)


def test_logs_are_json_lines_with_the_request_and_trace_ids(live):
    from tests.e2e.live import ray_session_logs

    failovers = []
    for path in ray_session_logs("serve", f"replica_{APP}_gateway_*.log"):
        for line in Path(path).read_text().splitlines():
            record = json.loads(line)  # every line is one JSON object
            if "could not take it" in record.get("message", ""):
                failovers.append(record)
    assert failovers, "the failed attempts on the bad version were logged"
    for record in failovers:
        assert re.fullmatch(r"[0-9a-f]{32}", record.get("trace_id", "")), record
        assert record.get("request_id") and record["request_id"] in record["message"], record
        assert SYSTEM[:20] not in json.dumps(record), "prompts are not logged by default"


def test_a_retired_version_drains_its_streams_within_the_drain_timeout(live):
    from tests.e2e.live import wait_replicas

    weights = f"{live.base}/admin/models/{MODEL}/weights"
    assert httpx.put(weights, json={"weights": {"v1": 50, "v2": 50}}, timeout=30).status_code == 200
    wait_replicas(APP, f"model-{MODEL}--v2", 1, timeout_s=300)
    session = next(f"s{i}" for i in range(200)
                   if live.chat("hi", user=f"s{i}").headers["x-shunter-version"] == "v2")
    events: list[str] = []

    def long_stream() -> None:
        with httpx.stream("POST", f"{live.base}/v1/chat/completions", timeout=300, json={
                "model": MODEL, "stream": True, "max_tokens": 1500, "ignore_eos": True, "user": session,
                "messages": [{"role": "user", "content": "Count slowly."}]}) as resp:
            events.extend(resp.iter_lines())

    streaming = threading.Thread(target=long_stream)
    streaming.start()
    deadline = time.monotonic() + 60
    while len(events) < 5 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.put(weights, json={"weights": {"v1": 100, "v2": 0}}, timeout=30).status_code == 200
    streaming.join(timeout=120)
    assert any("replica_drain_timeout" in e for e in events), "the stream was ended with a clear error event"


def _burst(live: Live, requests: int = 12) -> list[httpx.Response]:
    """Requests at once, past what the model admits (4 running, none queued, per replica)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(requests) as pool:
        return list(pool.map(lambda i: live.chat(f"Burst question {i}: name a river.", max_tokens=16),
                             range(requests)))


def test_a_burst_past_the_bound_is_refused_at_once_and_counted_by_class(live):
    answers = _burst(live)
    refused = [a for a in answers if a.status_code == 429]
    assert refused and any(a.status_code == 200 for a in answers), [a.status_code for a in answers]
    assert all(a.json()["error"]["code"] == "queue_full" and int(a.headers["retry-after"]) >= 1 for a in refused)
    assert all(a.headers["x-shunter-priority"] == "standard" for a in answers), "the default class, without keys"


def test_every_metric_the_dashboards_query_is_exported_by_the_live_app(live):
    from shunter.ops.dashboards.dashboards import all_dashboards
    from shunter.ops.dashboards.promql_names import allowed_external_metrics, dashboard_metric_names

    wanted = set().union(*(dashboard_metric_names(board) for board in all_dashboards()))
    external = set(allowed_external_metrics())
    exported: set[str] = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # Ray's metrics agent exports every few seconds
        text = httpx.get(live.metrics_url, timeout=10).text
        exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
        if wanted <= exported:
            break
        time.sleep(3)
    missing = wanted - exported
    assert not missing - external, f"dashboards query metrics the live app does not export: {sorted(missing)}"
    assert not missing, f"allow-listed metrics not exported by this Ray: {sorted(missing & external)}"


# Panels this app cannot give data, each with its reason. Prometheus takes a series' first sample as its
# baseline, so an event that happens once, on a series it creates, never shows in rate() or increase():
# the module drains one replica once and never completes a rollout whose new version has latencies.
NO_DATA_HERE = {
    ("shunter-capacity", "Drain duration"): "one drain in the module: its histogram is born with it",
    ("shunter-capacity", "Streams aborted at the drain timeout"): "one abort: its counter is born with it",
    ("shunter-rollouts", "Gate: p95 latency, new vs old"): "the only rollout goes to a version that never answers",
}


def test_every_dashboard_expression_returns_data_from_prometheus(live):
    """Each panel query, as Grafana sends it (variables at All, SLO variables at their first option,
    `$__rate_interval` 1m), over the module's whole run: Prometheus's own evaluation, not a copy of it.
    Streams in a few rounds first, so the latency histograms grow on series that already exist."""
    from shunter.ops.dashboards.builder import panels_of
    from shunter.ops.dashboards.dashboards import all_dashboards
    from shunter.ops.dashboards.promql_names import interpolate, slo_values

    for round_ in range(3):
        _burst(live)  # refusals rise on a series that exists: the flow dashboard's refusal panels
        for i in range(2):
            with httpx.stream("POST", f"{live.base}/v1/chat/completions", timeout=120, json={
                    "model": MODEL, "stream": True, "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"Count to {round_ * 2 + i + 3}."}]}) as resp:
                assert resp.status_code == 200
                resp.read()
        time.sleep(5)  # past Ray's metrics export (2 s here) and a scrape: the next round is an increase
    time.sleep(6)
    step, end = 5.0, time.time()
    start = end - step * ((end - live.started_at + 60) // step)  # the last step is now
    empty, checked = [], 0
    for board in all_dashboards():
        for panel in panels_of(board):
            if (board["uid"], panel["title"]) in NO_DATA_HERE:
                continue
            for target in panel.get("targets", []):
                expr = interpolate(target["expr"], slo_values(board))
                checked += 1
                if not has_data(live.prometheus.query_range(expr, start, end, step)):
                    empty.append(f"{board['uid']} / {panel['title']} / {target['refId']}: {expr}")
    assert checked > 50
    assert not empty, "expressions with no data from the live app:\n" + "\n".join(empty)
