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
from typing import Any

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


def _args(otlp_endpoint: str, adapters: dict[str, str], state: Path) -> dict:
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
        # A batch runs too: the flow dashboard's batch panels.
        "batch": {"state": str(state / "batch.sqlite3"), "files": str(state / "files")},
    }


class Live:
    def __init__(self, base: str, metrics_url: str, spans: OTLPReceiver, prometheus: Prometheus):
        self.base, self.metrics_url, self.spans, self.prometheus = base, metrics_url, spans, prometheus
        self.started_at = time.time()
        self.adapter_answers: dict[str, str] = {}  # each adapter's greedy answer when it was first loaded

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
            local_app(_args(receiver.endpoint, adapters, tmp_path_factory.mktemp("batch")), APP,
                      metrics_port=metrics_port) as base, \
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


def _ask_adapters(live: Live) -> dict[str, str]:
    """Each adapter's greedy answer to the same question, asked in turn (12 tokens: enough for two seeded
    adapters to answer apart, tests/e2e/test_routing_adapters.py)."""
    answers = {}
    for name in ADAPTERS:
        resp = httpx.post(f"{live.base}/v1/chat/completions", timeout=120, json={
            "model": name, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert resp.status_code == 200 and resp.json()["model"] == name, resp.text
        answers[name] = resp.json()["choices"][0]["message"]["content"]
    return answers


def _adapters_on_v1(live: Live) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """v1's one replica's own record of its engine's adapters (`stats`: those held, least recently used
    first, and how often each was loaded), and which replicas the gateway's routers believe hold each."""
    from ray import serve

    from shunter.replica_protocol import RouteHint

    listed = httpx.get(f"{live.base}/admin/models/{MODEL}/replicas", timeout=60).json()["replicas"]
    (replica,) = [r["replica"] for r in listed if r["version"] == "v1"]
    handle = serve.get_deployment_handle(f"model-{MODEL}--v1", app_name=APP)
    stats = handle.stats.remote(RouteHint(pin=replica)).result(timeout_s=60)
    rows = httpx.get(f"{live.base}/admin/models/{MODEL}/adapters", timeout=60).json()["adapters"]
    return {"replica": replica, **stats}, {row["name"]: row["held_by"] for row in rows}


def _wait_held_by(live: Live, held_by: dict[str, list[str]], timeout_s: float = 60) -> None:
    """The gateway's picture (the routers' copy, corrected by each replica report) until it is `held_by`."""
    deadline, seen = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        _, seen = _adapters_on_v1(live)
        if seen == held_by:
            return
        time.sleep(0.5)
    raise AssertionError(f"the gateway believes {seen}, not {held_by}")


def test_requests_to_lora_adapters_are_served_each_loaded_in_turn(live):
    """Two adapters on a replica that holds one (max_cpu_loras 1): obs-a is loaded, then evicted when obs-b
    is loaded; the replica's engine holds only obs-b and the gateway knows it. The next test but one asks
    again, long enough after (the replica exports every few seconds) that the adapter panels' rates have
    a baseline to rise from."""
    answers = _ask_adapters(live)
    first, second = ADAPTERS
    assert answers[first] != answers[second], f"each adapter's own weights answer: {answers}"
    live.adapter_answers.update(answers)
    stats, _ = _adapters_on_v1(live)
    assert stats["adapter_capacity"] == 1 and stats["adapters"] == [second], stats
    assert stats["adapter_loads"] == {first: 1, second: 1}, stats
    _wait_held_by(live, {first: [], second: [stats["replica"]]})


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
    """The second round: each adapter, evicted by the other since, is loaded again (its load counter
    rises) and answers as it did when first loaded."""
    assert live.adapter_answers, "the first round ran"
    assert _ask_adapters(live) == live.adapter_answers, "reloaded after its eviction, each answers as before"
    stats, _ = _adapters_on_v1(live)
    assert stats["adapter_loads"] == dict.fromkeys(ADAPTERS, 2) and stats["adapters"] == [ADAPTERS[-1]], stats
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
    batch = _start_a_batch(live)  # its gauges live while it runs: the check runs beside it
    exported: set[str] = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # Ray's metrics agent exports every few seconds
        text = httpx.get(live.metrics_url, timeout=10).text
        exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
        if wanted <= exported:
            break
        time.sleep(3)
    _finish(live, batch)
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


def _caught_up(live: Live, counted: float = 0, sent: int = 0, timeout_s: float = 120, whole_s: float = 30) -> float:
    """Until Ray's exporter (every 2 s here) counts the model's requests and Prometheus has scraped what it
    counts (`counted` before the last `sent` requests): waiting for the data, not for a guess at the export's
    pace. Returns the count.

    Ray 2.60's metrics agent adds up the deltas each worker sends (`set_metric_value` in its
    open_telemetry_metric_recorder), and a delta lost on a loaded machine is never sent again: CI once saw a
    whole burst's 12 missing for good. So the count must reach `counted + sent` within `whole_s`; after that,
    any growth past `counted` does (the data this module needs is an increase, not its exact size)."""
    from tests.e2e.live import metric_total

    def exported() -> float:
        return metric_total(httpx.get(live.metrics_url, timeout=10).text, "ray_shunter_requests_total", model=MODEL)

    def scraped() -> float:
        return sum(float(s["value"][1]) for s in live.prometheus.query(
            f'sum(ray_shunter_requests_total{{model="{MODEL}"}})'))

    started = time.monotonic()
    while True:
        now, elapsed = exported(), time.monotonic() - started
        if (now >= counted + sent or (elapsed > whole_s and now > counted)) and scraped() >= now:
            return now
        assert elapsed < timeout_s, f"{counted} + {sent} requests: exported {now}, scraped {scraped()}"
        time.sleep(0.5)


def _stream_honouring_retry_after(live: Live, content: str, attempts: int = 5) -> int:
    """A short stream read to its end, as a client does it after a burst: the places a burst's refusals
    keep for their retries are taken until their Retry-After, so a 429 is retried after it. Returns the
    requests sent (each is counted)."""
    for attempt in range(1, attempts + 1):
        with httpx.stream("POST", f"{live.base}/v1/chat/completions", timeout=120, json={
                "model": MODEL, "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": content}]}) as resp:
            resp.read()
        if resp.status_code != 429 or attempt == attempts:
            assert resp.status_code == 200, resp.text
            return attempt
        time.sleep(float(resp.headers["retry-after"]))
    raise AssertionError("unreachable")


def _start_a_batch(live: Live, lines: int = 48) -> dict:
    """A batch of chats through the Batch API (the flow dashboard's batch panels): long enough (a few lines at
    a time in the least urgent class) for its gauges to be exported and scraped while it runs."""
    requests = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": f"Count to {i + 3}."}]}}).encode()
        + b"\n" for i in range(lines))
    uploaded = httpx.post(f"{live.base}/v1/files", files={"file": ("in.jsonl", requests)}, data={"purpose": "batch"},
                          timeout=60).json()
    batch = httpx.post(f"{live.base}/v1/batches", timeout=60, json={
        "input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    assert batch["status"] == "validating", batch
    return batch


def _finish(live: Live, batch: dict) -> None:
    """Until the batch ends: every line answered."""
    deadline = time.monotonic() + 300
    while batch["status"] not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(1)
        batch = httpx.get(f"{live.base}/v1/batches/{batch['id']}", timeout=60).json()
    counts = batch["request_counts"]
    assert batch["status"] == "completed" and counts["completed"] == counts["total"] > 0, batch


def test_every_dashboard_expression_returns_data_from_prometheus(live):
    """Each panel query, as Grafana sends it (variables at All, SLO variables at their first option,
    `$__rate_interval` 1m), over the module's whole run: Prometheus's own evaluation, not a copy of it.
    Streams in a few rounds first, so the latency histograms grow on series that already exist."""
    from shunter.ops.dashboards.builder import panels_of
    from shunter.ops.dashboards.dashboards import all_dashboards
    from shunter.ops.dashboards.promql_names import interpolate, slo_values

    counted = _caught_up(live)
    for round_ in range(3):
        sent = 0
        for i in range(2):
            sent += _stream_honouring_retry_after(live, f"Count to {round_ * 2 + i + 3}.")
        sent += len(_burst(live))  # refusals rise on a series that exists: the flow dashboard's refusal panels
        # In Prometheus before the next round: that one is an increase on the series this one left.
        counted = _caught_up(live, counted, sent)
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
