"""A real Prometheus, as `shunter demo` and the dashboard tests run it (shunter.cli.demo.prometheus), scraping a
real exporter (prometheus_client's, fed by a thread at known rates), and the PNG renderer drawing a small
dashboard from its range queries. No Ray: what is tested is the Prometheus side."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from shunter.cli.demo.panels.render import evaluate_panel, render_all, render_dashboard, step_times
from shunter.cli.demo.prometheus import Prometheus, PrometheusError, has_data, values_of
from shunter.local_serve import free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCRAPE_S = 1.0
RATES = {"a": 10, "b": 30}  # requests per second the feeder counts for each model


def _scrapes(prometheus: Prometheus) -> int:
    """How many scrapes of the exporter Prometheus holds (its `up` samples)."""
    return sum(int(float(sample["value"][1])) for sample in prometheus.query("count_over_time(up[1h])"))


def _wait_for_scrapes(prometheus: Prometheus, more: int, timeout_s: float = 60) -> None:
    """Until Prometheus holds `more` scrapes than now: counted in Prometheus, not guessed from the interval."""
    wanted, deadline = _scrapes(prometheus) + more, time.monotonic() + timeout_s
    while _scrapes(prometheus) < wanted:
        assert time.monotonic() < deadline, f"Prometheus scraped {_scrapes(prometheus)} times, not {wanted}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def prometheus() -> Iterator[Prometheus]:
    registry = CollectorRegistry()
    requests = Counter("req", "Requests.", ["model"], registry=registry)
    latency = Histogram("lat_seconds", "Latency.", ["model"], buckets=(0.1, 0.5, 1.0), registry=registry)
    Gauge("queue", "Queued.", ["model"], registry=registry).labels(model="a").set(3)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    stop = threading.Event()

    def feed() -> None:
        while not stop.wait(0.1):
            for model, rate in RATES.items():
                requests.labels(model=model).inc(rate / 10)
                latency.labels(model=model).observe(0.3)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        with Prometheus([f"127.0.0.1:{port}"], scrape_interval_s=SCRAPE_S) as running:
            running.wait_scraped(timeout_s=30)
            running.started = time.time()  # type: ignore[attr-defined]
            _wait_for_scrapes(running, 6)  # enough for the rate windows below
            yield running
    finally:
        stop.set()
        server.shutdown()


@pytest.mark.timeout(90)
def test_prometheus_computes_rates_and_quantiles_of_the_scraped_series(prometheus):
    rates = {s["metric"]["model"]: float(s["value"][1])
             for s in prometheus.query("sum by (model) (rate(req_total[5s]))")}
    assert set(rates) == {"a", "b"} and 0 < rates["a"] < rates["b"], rates
    p50 = prometheus.query('histogram_quantile(0.5, sum by (le) (rate(lat_seconds_bucket{model="a"}[5s])))')
    assert 0.1 <= float(p50[0]["value"][1]) <= 0.5, "every observation is 0.3 s: in the (0.1, 0.5] bucket"
    assert prometheus.query("scalar(queue)") and not has_data(prometheus.query("nothing_exported_total"))


@pytest.mark.timeout(60)
def test_a_bad_query_is_refused_with_prometheus_own_message(prometheus):
    with pytest.raises(PrometheusError, match="parse error"):
        prometheus.query("sum(rate(req_total[5s])")


@pytest.mark.timeout(60)
def test_range_queries_answer_on_the_renderers_grid(prometheus):
    end = time.time()
    grid = step_times(prometheus.started - 2, end, 1.0)
    (series,) = prometheus.query_range('rate(req_total{model="b"}[3s])', grid[0], grid[-1], 1.0)
    times = [t for t, _ in values_of(series)]
    assert times and set(times) <= set(grid), "Prometheus evaluated at the grid's instants"


def _tiny_dashboard() -> dict:
    return {
        "title": "Tiny", "uid": "tiny",
        "templating": {"list": [{"name": "model", "type": "query", "includeAll": True,
                                 "current": {"value": "$__all"}}]},
        "panels": [
            {"type": "row", "title": "Traffic", "panels": []},
            {"type": "timeseries", "title": "Requests", "fieldConfig": {"defaults": {"unit": "reqps"}},
             "targets": [{"refId": "A", "legendFormat": "{{model}}",
                          "expr": 'sum by (model) (rate(req_total{model=~"$model"}[$__rate_interval]))'}]},
            {"type": "stat", "title": "Nothing here", "fieldConfig": {"defaults": {"unit": "s"}},
             "targets": [{"refId": "A", "expr": "sum(not_exported_total)"}]},
            {"type": "stat", "title": "Broken", "targets": [{"refId": "A", "expr": "sum(("}]},
            {"type": "text", "title": "Notes"},
        ],
    }


@pytest.mark.timeout(60)
def test_panels_are_evaluated_by_prometheus_and_drawn(prometheus, tmp_path):
    requests, nothing, broken = _tiny_dashboard()["panels"][1:4]
    grid = step_times(prometheus.started, time.time(), 1.0)
    data = evaluate_panel(requests, prometheus, grid, 1.0, {"model": "All"}, "4s", "10s")
    assert [label for label, _ in data.lines] == ["a", "b"] and data.has_data()
    empty = evaluate_panel(nothing, prometheus, grid, 1.0, {"model": "All"}, "4s", "10s")
    assert not empty.has_data() and not empty.errors
    failed = evaluate_panel(broken, prometheus, grid, 1.0, {}, "4s", "10s")
    assert not failed.has_data() and "parse error" in failed.errors[0], "a broken query says so in its box"

    out = render_dashboard(_tiny_dashboard(), prometheus, tmp_path / "tiny.png", grid[0], grid[-1], step_s=1.0)
    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 10_000
    (tmp_path / "dash").mkdir()
    (tmp_path / "dash" / "tiny.json").write_text(json.dumps(_tiny_dashboard()))
    paths = render_all(tmp_path / "dash", prometheus, tmp_path / "out", grid[0], grid[-1], {"tiny": ["Requests"]},
                       step_s=1.0)
    assert paths == [tmp_path / "out" / "tiny.png"] and paths[0].read_bytes().startswith(PNG_MAGIC)
    with pytest.raises(ValueError, match="Missing panel"):
        render_dashboard(_tiny_dashboard(), prometheus, tmp_path / "x.png", grid[0], grid[-1], ["Missing panel"])
