"""Panel rendering without Grafana: the sample store, the PromQL evaluator against hand-computed numbers,
Grafana variable interpolation, and the PNG renderer on a tiny dashboard."""

from __future__ import annotations

import json
import math
import threading

import httpx
import pytest

from shunter.ops.panels.promql import (
    PromQLError,
    UnsupportedPromQL,
    bucket_quantile,
    evaluate_instant,
    evaluate_range,
    interpolate,
)
from shunter.ops.panels.render import (
    dashboard_variables,
    display_title,
    evaluate_panel,
    format_value,
    legend,
    render_all,
    render_dashboard,
)
from shunter.ops.panels.scrape import SampleStore, freeze_labels, scrape_loop

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_000.0
STEP = 10.0
SCRAPES = 13  # T0 .. T0 + 120
END = T0 + STEP * (SCRAPES - 1)

# Per-second rates of the synthetic counters.
RATES = {("a", "200", "w1"): 1.0, ("a", "200", "w2"): 1.0, ("a", "503", "w1"): 0.5, ("b", "200", "w1"): 3.0}
# Cumulative bucket increments per 10 s scrape interval: le=0.1, 0.5, 1, +Inf.
BUCKET_BOUNDS = ("0.1", "0.5", "1.0", "+Inf")
BUCKET_STEPS = {"w1": (2, 6, 9, 10), "w2": (2, 2, 2, 2)}


def _exposition(i: int) -> str:
    """The i-th scrape, as Ray's exporter would write it (metric names as exported, with suffixes)."""
    lines = ["# HELP req_total Requests.", "# TYPE req_total counter"]
    for (model, status, worker), rate in RATES.items():
        lines.append(f'req_total{{model="{model}",status="{status}",worker="{worker}"}} {rate * STEP * i}')
    lines += ["# HELP lat_seconds Latency.", "# TYPE lat_seconds histogram"]
    for worker, steps in BUCKET_STEPS.items():
        for le, per_step in zip(BUCKET_BOUNDS, steps, strict=True):
            lines.append(f'lat_seconds_bucket{{model="a",worker="{worker}",le="{le}"}} {per_step * i}')
        lines.append(f'lat_seconds_sum{{model="a",worker="{worker}"}} {0.5 * steps[-1] * i}')
        lines.append(f'lat_seconds_count{{model="a",worker="{worker}"}} {steps[-1] * i}')
    for le in BUCKET_BOUNDS:  # a histogram that never observed anything
        lines.append(f'lat_seconds_bucket{{model="idle",worker="w1",le="{le}"}} 0')
    lines += ["# TYPE queue gauge", f'queue{{model="a"}} {i % 4}']
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def store() -> SampleStore:
    samples = SampleStore()
    for i in range(SCRAPES):
        samples.add_scrape(_exposition(i), T0 + STEP * i)
    return samples


def _values(expr: str, store: SampleStore, t: float = END, key: str | None = None) -> dict:
    """Instant results as {label value (or the whole label dict as a tuple): value}."""
    result = {}
    for sample in evaluate_instant(expr, store, t):
        result[sample.labels.get(key) if key else tuple(sorted(sample.labels.items()))] = sample.value
    return result


# ---- the store ------------------------------------------------------------------------------------------


def test_store_keeps_exported_names_labels_and_times(store):
    buckets = store.series("lat_seconds_bucket")
    assert freeze_labels({"model": "a", "worker": "w1", "le": "+Inf"}) in buckets
    points = store.series("req_total")[freeze_labels({"model": "b", "status": "200", "worker": "w1"})]
    assert points[:3] == [(T0, 0.0), (T0 + 10, 30.0), (T0 + 20, 60.0)]
    assert len(store.times()) == SCRAPES
    assert store.scrape_interval() == STEP
    assert {"req_total", "lat_seconds_count", "lat_seconds_sum", "queue"} <= set(store.names())


def test_a_malformed_scrape_stores_nothing():
    samples = SampleStore()
    with pytest.raises(ValueError):
        samples.add_scrape('ok_total 1\nbroken{a="b" 1\n', T0)
    assert samples.names() == [] and samples.times() == []


def test_scrape_loop_survives_failed_scrapes():
    stop = threading.Event()
    replies = iter([httpx.Response(200, text="up 1\n"), httpx.Response(500), httpx.Response(200, text="x{ 1")])

    def handler(request: httpx.Request) -> httpx.Response:
        reply = next(replies)
        if reply.status_code == 200 and reply.text.startswith("x"):
            stop.set()  # the third scrape is the last
        return reply

    samples = SampleStore()
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        good = scrape_loop("http://metrics/", samples, 0.0, stop, client=client)
    assert good == 1
    assert len(samples.series("up")) == 1


# ---- selectors and rates ------------------------------------------------------------------------------------


def test_rate_of_a_counter(store):
    rates = _values("rate(req_total[1m])", store)
    expected = {tuple(sorted({"model": m, "status": s, "worker": w}.items())): r for (m, s, w), r in RATES.items()}
    assert rates == pytest.approx(expected)  # the metric name is dropped, as Prometheus does
    assert _values("irate(req_total{model='b'}[1m])", store, key="model") == pytest.approx({"b": 3.0})
    # increase == rate * range
    assert _values("increase(req_total{model='b'}[1m])", store, key="model") == pytest.approx({"b": 180.0})


def test_rate_handles_a_counter_reset():
    samples = SampleStore()
    for t, value in ((0, 0), (10, 10), (20, 20), (30, 5), (40, 15)):  # restarted between 20 and 30
        samples.add_sample("c_total", {}, T0 + t, value)
    # increase: 20 before the restart + 15 after, over the 40 s the samples span
    assert evaluate_instant("rate(c_total[1m])", samples, T0 + 40)[0].value == pytest.approx(35 / 40)
    assert evaluate_instant("irate(c_total[1m])", samples, T0 + 40)[0].value == pytest.approx(1.0)
    assert evaluate_instant("irate(c_total[1m])", samples, T0 + 30)[0].value == pytest.approx(0.5)  # 0 -> 5
    # windows are left-open, (t - range, t]: the sample at T0 + 20 (before the restart) is outside
    assert evaluate_instant("increase(c_total[20s])", samples, T0 + 40)[0].value == pytest.approx(20.0)


def test_rate_needs_two_samples_and_instant_selectors_look_back_five_minutes(store):
    assert _values("rate(req_total[1m])", store, t=T0) == {}
    assert _values("queue", store, t=END + 299, key="model") == {"a": 0.0}  # i=12 -> 12 % 4
    assert _values("queue", store, t=END + 301) == {}
    assert _values("queue", store, t=T0 - 1) == {}
    assert _values("avg_over_time(queue[20s])", store, key="model") == {"a": 1.5}  # i = 11, 12 -> 3, 0


def test_sum_by_and_without(store):
    assert _values("sum by (model) (rate(req_total[1m]))", store, key="model") == pytest.approx(
        {"a": 2.5, "b": 3.0})
    without = _values("sum without (worker, status) (rate(req_total[1m]))", store, key="model")
    assert without == pytest.approx({"a": 2.5, "b": 3.0})
    assert _values("sum(rate(req_total[1m]))", store) == pytest.approx({(): 5.5})
    assert _values("count by (model) (req_total)", store, key="model") == {"a": 3.0, "b": 1.0}
    assert _values("max(rate(req_total[1m]))", store) == pytest.approx({(): 3.0})
    assert _values("avg by (model) (rate(req_total[1m]))", store, key="model") == pytest.approx(
        {"a": 2.5 / 3, "b": 3.0})
    assert _values("sum without (worker, status) (req_total)", store) == {(("model", "a"), ): 300.0,
                                                                           (("model", "b"), ): 360.0}
    top = _values("topk(1, rate(req_total[1m]))", store, key="model")
    assert top == pytest.approx({"b": 3.0})


def test_label_matchers_including_regex(store):
    def count(selector: str) -> int:
        return len(evaluate_instant(selector, store, END))

    assert count('req_total{model="a"}') == 3
    assert count('req_total{model="a", status!="503"}') == 2
    assert count('req_total{status=~"5.."}') == 1
    assert count('req_total{status=~"5"}') == 0  # regexes are anchored at both ends
    assert count('req_total{worker!~"w1|w3"}') == 1
    assert count('req_total{model=~"a|b", worker="w1"}') == 3
    assert count('req_total{missing=""}') == 4  # an absent label matches the empty string
    assert count('{__name__=~"req_.*", model="b"}') == 1
    assert count('req_total{model="b" or worker="w2"}') == 2


# ---- histograms --------------------------------------------------------------------------------------------


def test_histogram_quantile_matches_hand_computation(store):
    # Both workers summed: per-second cumulative rates 0.4, 0.8, 1.1, 1.2 at le 0.1, 0.5, 1, +Inf.
    # p50: rank 0.6 lies in (0.1, 0.5], which holds 0.4 of them from 0.4 up: 0.1 + 0.4 * (0.2 / 0.4) = 0.3.
    query = "histogram_quantile({q}, sum by (le) (rate(lat_seconds_bucket{{model='a'}}[1m])))"
    assert _values(query.format(q=0.5), store)[()] == pytest.approx(0.3)
    # p75: rank 0.9 in (0.5, 1] (0.8 -> 1.1): 0.5 + 0.5 * (0.1 / 0.3)
    assert _values(query.format(q=0.75), store)[()] == pytest.approx(0.5 + 0.5 / 3)
    # p99: rank 1.188 lies in the +Inf bucket: the highest finite bound
    assert _values(query.format(q=0.99), store)[()] == pytest.approx(1.0)
    # grouped per worker: w1 rates 0.2, 0.6, 0.9, 1.0 -> p50 = 0.1 + 0.4 * (0.3 / 0.4) = 0.4;
    # w2 has everything in the first bucket -> p50 = 0.1 * 0.5 = 0.05
    per_worker = _values("histogram_quantile(0.5, sum by (le, worker) (rate(lat_seconds_bucket{model='a'}[1m])))",
                         store, key="worker")
    assert per_worker == pytest.approx({"w1": 0.4, "w2": 0.05})


def test_histogram_quantile_of_raw_buckets_drops_the_metric_name(store):
    # at the last scrape w1's cumulative counts are 24, 72, 108, 120: the same shape as its rates
    result = evaluate_instant("histogram_quantile(0.5, lat_seconds_bucket{model='a', worker='w1'})", store, END)
    assert [(s.labels, s.value) for s in result] == [({"model": "a", "worker": "w1"}, pytest.approx(0.4))]


def test_histogram_quantile_without_observations_is_nan(store):
    idle = _values("histogram_quantile(0.5, rate(lat_seconds_bucket{model='idle'}[1m]))", store, key="model")
    assert list(idle) == ["idle"] and math.isnan(idle["idle"])


def test_bucket_quantile_edge_cases():
    assert math.isnan(bucket_quantile(0.5, [(0.1, 1.0), (0.5, 2.0)]))  # no +Inf bucket
    assert math.isnan(bucket_quantile(0.5, [(math.inf, 3.0)]))  # a single bucket
    assert bucket_quantile(-0.1, [(1.0, 1.0), (math.inf, 1.0)]) == -math.inf
    # counts that drop with the bound are raised to 2, 2, 3, 3: the median (rank 1.5) is in the first bucket
    assert bucket_quantile(0.5, [(1.0, 2.0), (2.0, 1.0), (3.0, 3.0), (math.inf, 3.0)]) == pytest.approx(0.75)


# ---- binary operators -------------------------------------------------------------------------------------


def test_error_ratio_between_vectors(store):
    ratio = _values('sum by (model) (rate(req_total{status=~"5.."}[1m])) / sum by (model) (rate(req_total[1m]))',
                    store, key="model")
    assert ratio == pytest.approx({"a": 0.2})  # b has no 5xx series, so nothing to match


def test_group_left_ignoring_and_scalars(store):
    share = _values("sum by (model, status) (rate(req_total[1m])) / ignoring(status) group_left "
                    "sum by (model) (rate(req_total[1m]))", store)
    assert share == pytest.approx({(("model", "a"), ("status", "200")): 0.8,
                                   (("model", "a"), ("status", "503")): 0.2,
                                   (("model", "b"), ("status", "200")): 1.0})
    copied = _values("sum by (model) (rate(req_total[1m])) * on(model) group_left(worker) "
                     "max by (model, worker) (rate(req_total{worker='w2'}[1m]))", store)
    assert copied == pytest.approx({(("model", "a"), ("worker", "w2")): 2.5})
    # one-to-one with on(): only the `on` labels survive
    assert _values("rate(req_total{worker='w2'}[1m]) / on(model) sum by (model) (rate(req_total[1m]))",
                   store) == pytest.approx({(("model", "a"),): 0.4})
    assert _values("sum(rate(req_total[1m])) * 60", store) == pytest.approx({(): 330.0})
    assert _values("-sum(rate(req_total[1m]))", store) == pytest.approx({(): -5.5})
    assert _values("vector(-(2))", store) == {(): -2.0}
    assert _values("1 - sum(rate(req_total[1m])) / 11", store) == pytest.approx({(): 0.5})
    assert _values("vector(0) / 0", store)[()] != _values("vector(0) / 0", store)[()]  # NaN, no exception
    assert _values("vector(1) / 0", store) == {(): math.inf}


def test_comparisons_and_set_operators(store):
    above = evaluate_instant("rate(req_total[1m]) > 0.9", store, END)
    assert sorted(s.value for s in above) == pytest.approx([1.0, 1.0, 3.0])
    filtered = _values('sum by (model) (rate(req_total[1m])) > sum by (model) (rate(req_total{status="200"}[1m]))',
                       store, key="model")
    assert filtered == pytest.approx({"a": 2.5})  # a comparison keeps the left side's value; b: 3 > 3 fails
    as_bool = _values("sum by (model) (rate(req_total[1m])) > bool 2.6", store, key="model")
    assert as_bool == {"a": 0.0, "b": 1.0}
    fallback = _values('sum by (model) (rate(req_total{status="503"}[1m])) or sum by (model) (rate(req_total[1m])) * 0',
                       store, key="model")
    assert fallback == pytest.approx({"a": 0.5, "b": 0.0})
    assert _values('req_total unless req_total{status="200"}', store, key="status") == {"503": 60.0}
    assert _values("clamp_max(sum(rate(req_total[1m])), 5)", store) == {(): 5.0}
    assert _values("clamp_min(sum(rate(req_total[1m])), 6)", store) == {(): 6.0}


def test_one_to_one_matching_rejects_ambiguity(store):
    with pytest.raises(PromQLError, match="several series"):
        evaluate_instant("rate(req_total[1m]) / on(model) sum by (model, status) (rate(req_total[1m]))",
                         store, END)


def test_range_evaluation_has_gaps_where_there_is_no_value(store):
    series = evaluate_range("sum(rate(req_total{model='a'}[30s]))", store, T0, END, STEP)
    assert len(series) == 1 and series[0].labels == {}
    times = [t for t, _ in series[0].points]
    assert times[0] == T0 + STEP  # at T0 the window holds one sample: no rate yet
    assert len(times) == SCRAPES - 1
    assert all(v == pytest.approx(2.5) for _, v in series[0].points)


def test_unsupported_constructs_raise_naming_them(store):
    with pytest.raises(UnsupportedPromQL, match="predict_linear"):
        evaluate_instant("predict_linear(req_total[1m], 60)", store, END)
    with pytest.raises(UnsupportedPromQL, match="subquer"):
        evaluate_instant("max_over_time(rate(req_total[1m])[5m:1m])", store, END)
    with pytest.raises(PromQLError, match="cannot parse") as error:
        evaluate_instant("sum(req_total", store, END)
    assert not isinstance(error.value, UnsupportedPromQL)


# ---- Grafana variables ------------------------------------------------------------------------------------


def test_interpolation_of_grafana_variables():
    expr = ('sum(rate(x{model=~"$model",version="${version}"}[$__rate_interval])) '
            '/ $__range_s + label_replace(y, "d", "$1", "s", "(.*)")[$__interval]')
    assert interpolate(expr, {"model": "All", "version": "v2"}, rate_interval="8s", interval="2s",
                       range_="5m") == ('sum(rate(x{model=~".*",version="v2"}[8s])) '
                                        '/ 300 + label_replace(y, "d", "$1", "s", "(.*)")[2s]')
    assert interpolate('x{m=~"$model"}', {"model": ["a", "b"]}) == 'x{m=~"(a|b)"}'
    assert interpolate('x{m=~"${model:regex}"}[$__rate_interval]', {"model": "$__all"}) == 'x{m=~".*"}[1m]'
    with pytest.raises(PromQLError, match="nomodel"):
        interpolate('x{m="$nomodel"}', {})


def test_dashboard_variables_default_to_all():
    dashboard = {"templating": {"list": [
        {"name": "model", "type": "query", "includeAll": True, "current": {"value": "$__all"}},
        {"name": "version", "type": "custom", "current": {"value": "v1"}},
        {"name": "node", "type": "query", "includeAll": True, "allValue": ".+", "current": {}},
        {"name": "ds", "type": "datasource", "current": {"value": "prometheus"}},
    ]}}
    assert dashboard_variables(dashboard) == {"model": "All", "version": "v1", "node": ".+"}


# ---- rendering --------------------------------------------------------------------------------------------


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
            {"type": "text", "title": "Notes"},
        ],
    }


def test_render_dashboard_writes_a_png(store, tmp_path):
    out = render_dashboard(_tiny_dashboard(), store, tmp_path / "tiny.png", step_s=STEP)
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_panel_evaluation_fills_legends_and_reports_no_data(store):
    requests, nothing = _tiny_dashboard()["panels"][1:3]
    variables = {"model": "All"}
    grid = [T0 + STEP * i for i in range(SCRAPES)]
    data = evaluate_panel(requests, store, grid, STEP, variables, "40s", "2m")
    assert [label for label, _ in data.lines] == ["a", "b"]
    assert math.isnan(data.lines[0][1][0]) and data.lines[0][1][-1] == pytest.approx(2.5)
    empty = evaluate_panel(nothing, store, grid, STEP, variables, "40s", "2m")
    assert not empty.has_data() and not empty.errors


def test_render_all_and_panel_selection(store, tmp_path):
    (tmp_path / "dash").mkdir()
    (tmp_path / "dash" / "tiny.json").write_text(json.dumps(_tiny_dashboard()))
    paths = render_all(tmp_path / "dash", store, tmp_path / "out", {"tiny": ["Requests"]}, step_s=STEP)
    assert paths == [tmp_path / "out" / "tiny.png"] and paths[0].read_bytes().startswith(PNG_MAGIC)
    with pytest.raises(ValueError, match="Missing panel"):
        render_dashboard(_tiny_dashboard(), store, tmp_path / "x.png", ["Missing panel"])


def test_legends_and_units():
    labels = {"__name__": "req_total", "model": "a", "status": "200"}
    assert legend("{{model}} / {{ status }}", labels, "q") == "a / 200"
    assert legend("", labels, "q") == 'req_total{model="a", status="200"}'
    assert legend(None, {}, "sum(x)") == "sum(x)"
    assert format_value(0.25, "s") == "250 ms"
    assert format_value(90, "s") == "1.5 min"
    assert format_value(0.2, "percentunit") == "20%"
    assert format_value(1500, "reqps") == "1.5k req/s"
    assert format_value(3, "short") == "3"
    assert display_title("TTFT ≤ $slo s (${model})", {"slo": "1.0", "model": ["a", "b"]}) == "TTFT ≤ 1.0 s (a, b)"
