"""The Grafana dashboards (ops/dashboards -> ops/grafana/): valid, laid out, current, and querying only
metrics that exist.

A dashboard query with a wrong metric name is valid to Grafana and Prometheus alike and shows "No
data" for ever; these tests are what catches it, by parsing every query and holding each name to the
metric catalog (or the allow-list of Ray / vLLM metrics).
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import yaml

from shunter import metric_catalog
from shunter.ops.dashboards import builder, generate
from shunter.ops.dashboards.builder import Query, Row, panels_of
from shunter.ops.dashboards.dashboards import BREAKER_SKIP, PLACEMENT_REASONS, RETRY, all_dashboards
from shunter.ops.dashboards.promql_names import (
    allowed_external_metrics,
    base_name,
    dashboard_metric_names,
    interpolate,
    metric_names,
    slo_values,
    variable_query_metric_names,
)
from shunter.ops.metrics import ROLLOUT_PHASES
from shunter.ops.rollout import Gates, WindowStats, evaluate_gates
from shunter.routing import policy

ROOT = generate.REPO_ROOT
ALLOW_LIST = ROOT / "ops" / "grafana" / "allowed_external_metrics.txt"
BOARDS = all_dashboards()
BOARD_IDS = [board["uid"] for board in BOARDS]


# ---- helpers --------------------------------------------------------------------------------------

def allowed_external() -> dict[str, str]:
    return allowed_external_metrics(ALLOW_LIST)


def known_series() -> set[str]:
    """Every series name Prometheus holds for the catalog: counters and gauges as exported, histograms
    only as their _bucket/_sum/_count series (a bare histogram name selects nothing)."""
    names = set()
    for spec in metric_catalog.CATALOG:
        if spec.kind == "histogram":
            names.update(spec.exported + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(spec.exported)
    return names


def targets(board: dict) -> list[tuple[dict, dict]]:
    return [(panel, target) for panel in panels_of(board) for target in panel.get("targets", [])]


def unknown_metrics(board: dict) -> set[str]:
    """Metric names a dashboard queries that neither the catalog nor the allow-list knows."""
    return dashboard_metric_names(board) - known_series() - set(allowed_external())


def by_uid(uid: str) -> dict:
    return next(board for board in BOARDS if board["uid"] == uid)


# ---- the query checker itself ----------------------------------------------------------------------

def test_metric_names_walks_every_kind_of_node():
    expr = ('histogram_quantile(0.95, sum by (le) (rate(a_bucket{model=~"$model"}[$__rate_interval])))'
            ' / on () group_left -sum(b) + max_over_time(c[5m:1m]) + topk(3, d) + {__name__="e"}'
            ' + (f) or vector(0) + count_values("v", g) + label_replace(h, "x", "$1", "y", "(.*)")')
    assert metric_names(expr) == set("abcdefgh") - {"a"} | {"a_bucket"}


def test_interpolate_fills_variables_as_grafana_would():
    expr = 'rate(x{model=~"$model", version=~"${version}", le="$slo"}[$__rate_interval]) offset $__range'
    assert interpolate(expr, {"slo": "1.0"}) == 'rate(x{model=~".*", version=~".*", le="1.0"}[1m]) offset 1h'


def test_interpolate_refuses_an_unknown_builtin():
    with pytest.raises(ValueError, match="__rate_intervl"):
        interpolate("rate(x[$__rate_intervl])")


def test_a_selector_without_a_metric_name_is_refused():
    with pytest.raises(ValueError, match="literal metric name"):
        metric_names('sum({model="a"})')


def test_invalid_promql_is_refused():
    with pytest.raises(ValueError):
        metric_names("sum(rate(x[1m])")


def test_variable_queries():
    assert variable_query_metric_names('label_values(ray_a{model=~"$model"}, version)') == {"ray_a"}
    assert variable_query_metric_names("label_values(model)") == set()


def test_base_name_strips_only_histogram_series_suffixes():
    assert base_name("ray_shunter_drain_seconds_bucket") == "ray_shunter_drain_seconds"
    assert base_name("ray_shunter_drain_seconds_count") == "ray_shunter_drain_seconds"
    assert base_name("ray_shunter_requests_total") == "ray_shunter_requests_total"


def test_a_typo_in_a_panel_is_caught():
    typo = builder.timeseries("Requests", "A typo'd metric name.",
                              [Query('sum(rate(ray_shunter_request_total{model=~"$model"}[$__rate_interval]))', "x")])
    bare_histogram = builder.timeseries("TTFT", "A histogram without its _bucket suffix.",
                                        [Query("sum(ray_shunter_time_to_first_token_seconds)", "x")])
    board = builder.dashboard(uid="t", title="t", description="t", variables=[builder.datasource_variable()],
                              rows=[Row("r", (typo, bare_histogram))])
    assert unknown_metrics(board) == {"ray_shunter_request_total", "ray_shunter_time_to_first_token_seconds"}


# ---- every dashboard -------------------------------------------------------------------------------

def test_the_six_dashboards_exist_with_stable_uids():
    assert BOARD_IDS == ["shunter-overview", "shunter-model", "shunter-routing", "shunter-capacity",
                         "shunter-flow", "shunter-rollouts"]


@pytest.mark.parametrize("uid", BOARD_IDS)
def test_checked_in_json_is_valid_and_matches(uid):
    text = (ROOT / "ops" / "grafana" / f"{uid}.json").read_text(encoding="utf-8")
    assert json.loads(text) == json.loads(json.dumps(by_uid(uid)))
    assert text.endswith("}\n") and '\n  "annotations"' in text  # 2-space indent, trailing newline


@pytest.mark.parametrize("uid", BOARD_IDS)
def test_schema_and_panel_ids(uid):
    board = by_uid(uid)
    assert board["schemaVersion"] == 39 and board["id"] is None
    ids = [panel["id"] for panel in panels_of(board)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {uid}"


@pytest.mark.parametrize("uid", BOARD_IDS)
def test_panels_do_not_overlap(uid):
    boxes = [(p["title"], p["gridPos"]) for p in panels_of(by_uid(uid))]
    for _, pos in boxes:
        assert pos["x"] >= 0 and pos["y"] >= 0 and pos["w"] > 0 and pos["h"] > 0
        assert pos["x"] + pos["w"] <= builder.GRID_WIDTH
    for (title_a, a), (title_b, b) in itertools.combinations(boxes, 2):
        apart = (a["x"] + a["w"] <= b["x"] or b["x"] + b["w"] <= a["x"]
                 or a["y"] + a["h"] <= b["y"] or b["y"] + b["h"] <= a["y"])
        assert apart, f"{uid}: {title_a!r} overlaps {title_b!r}"


@pytest.mark.parametrize("uid", BOARD_IDS)
def test_every_panel_is_described_and_queries_the_chosen_datasource(uid):
    board = by_uid(uid)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels_of(board):
        if panel["type"] == "row":
            continue
        assert panel["description"].strip(), f"{uid}: {panel['title']!r} has no description"
        assert panel["datasource"] == builder.DATASOURCE and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == builder.DATASOURCE


@pytest.mark.parametrize("uid", BOARD_IDS)
def test_model_variable(uid):
    model = next(v for v in by_uid(uid)["templating"]["list"] if v["name"] == "model")
    assert model["query"]["query"] == "label_values(ray_shunter_requests_total, model)"
    assert model["multi"] and model["includeAll"]


@pytest.mark.parametrize("uid", BOARD_IDS)
def test_every_query_parses_and_names_only_known_metrics(uid):
    board = by_uid(uid)
    for panel, target in targets(board):
        try:
            metric_names(target["expr"], slo_values(board))
        except ValueError as error:
            pytest.fail(f"{uid}: {panel['title']!r}: {error}")
    assert unknown_metrics(board) == set()


@pytest.mark.parametrize("uid", BOARD_IDS)
def test_rates_use_the_rate_interval(uid):
    """A fixed range ([5m]) is too short for a slow scrape and blurs a zoomed-in graph."""
    for panel, target in targets(by_uid(uid)):
        for window in re.findall(r"\[([^\]]*)\]", target["expr"]):
            assert window == "$__rate_interval", f"{uid}: {panel['title']!r} uses [{window}]"


def test_slo_variables_offer_real_bucket_boundaries():
    board = by_uid("shunter-overview")
    exprs = [target["expr"] for _, target in targets(board)]
    slo_variables = [v for v in board["templating"]["list"] if v["type"] == "custom"]
    assert {v["name"] for v in slo_variables} == {"slo_ttft", "slo_e2e"}
    for variable in slo_variables:
        # The histogram each variable is compared with, from the queries that really use it.
        bucket_series = {m for expr in exprs
                         for m in re.findall(rf'(\w+)_bucket\{{[^}}]*le="\${variable["name"]}"', expr)}
        assert len(bucket_series) == 1, f"{variable['name']} is used with {bucket_series}"
        (histogram_name,) = bucket_series
        histogram = next(s for s in metric_catalog.CATALOG if s.exported == histogram_name)
        for option in variable["options"]:
            # As the exporter writes `le` (a float: "1.0", never "1"), or the matcher selects nothing.
            assert float(option["value"]) in histogram.buckets, (variable["name"], option)
            assert option["value"] == repr(float(option["value"]))
        assert variable["current"]["value"] in [o["value"] for o in variable["options"]]


def test_routing_reasons_are_routings_own():
    from shunter.routing.routers import BREAKER_SKIP as ROUTER_BREAKER_SKIP
    from shunter.routing.routers import RETRY as ROUTER_RETRY

    assert PLACEMENT_REASONS == (policy.PREFIX_HIT, policy.LOAD_FALLBACK, policy.LEAST_LOADED)
    assert (BREAKER_SKIP, RETRY) == (ROUTER_BREAKER_SKIP, ROUTER_RETRY)


def test_rollout_panels_match_real_gate_and_phase_names():
    gate_names = set(evaluate_gates(WindowStats(), WindowStats(), Gates()).values)
    exprs = [target["expr"] for _, target in targets(by_uid("shunter-rollouts"))]
    gate_patterns = [p for expr in exprs for p in re.findall(r'gate=~"([^"]+)"', expr)]
    assert gate_patterns
    covered = set()
    for pattern in gate_patterns:
        matched = {name for name in gate_names if re.fullmatch(pattern, name)}
        assert matched, f"gate pattern {pattern!r} matches none of {sorted(gate_names)}"
        covered |= matched
    assert covered == gate_names, f"gates no panel shows: {gate_names - covered}"
    phases = {p for expr in exprs for p in re.findall(r'phase="([^"]+)"', expr)}
    assert phases == set(ROLLOUT_PHASES)


# ---- the allow-list --------------------------------------------------------------------------------

def test_allow_list_entries_have_reasons_and_are_not_shunter_metrics():
    entries = allowed_external()
    for name, reason in entries.items():
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name), name
        assert reason, f"{name} needs a reason"
        assert not name.startswith(metric_catalog.RAY_PREFIX + "shunter_"), f"{name} belongs in the catalog"


def test_every_allow_listed_metric_is_used():
    used = set()
    for board in BOARDS:
        for _, target in targets(board):
            used |= metric_names(target["expr"], slo_values(board))
    assert set(allowed_external()) <= used, "drop allow-list entries no dashboard uses"


# ---- generated files -------------------------------------------------------------------------------

def test_checked_in_files_are_current():
    assert generate.check() == [], "run `make dashboards` and commit ops/grafana/"


def test_check_names_stale_missing_and_left_over_files(tmp_path: Path):
    generate.write(tmp_path)
    assert generate.check(tmp_path) == []
    overview = tmp_path / "ops" / "grafana" / "shunter-overview.json"
    overview.write_text(overview.read_text().replace("Requests/s", "Requests per second"))
    (tmp_path / "ops" / "grafana" / "shunter-routing.json").unlink()
    (tmp_path / "ops" / "grafana" / "shunter-old.json").write_text("{}\n")
    assert generate.check(tmp_path) == ["stale: ops/grafana/shunter-overview.json",
                                        "missing: ops/grafana/shunter-routing.json",
                                        "not generated (remove it): ops/grafana/shunter-old.json"]
    assert generate.main(["--check", "--root", str(tmp_path)]) == 1
    generate.write(tmp_path)
    assert generate.main(["--check", "--root", str(tmp_path)]) == 0


def test_output_is_deterministic():
    assert generate.outputs() == generate.outputs()


def test_configmaps_carry_the_sidecar_label_and_the_same_json():
    maps = [doc for doc in yaml.safe_load_all((ROOT / generate.CONFIGMAPS).read_text()) if doc]
    assert [m["metadata"]["name"] for m in maps] == [f"grafana-dashboard-{uid}" for uid in BOARD_IDS]
    for config_map, uid in zip(maps, BOARD_IDS, strict=True):
        assert config_map["kind"] == "ConfigMap"
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["annotations"]["grafana_folder"] == "Shunter"
        assert config_map["data"] == {f"{uid}.json": generate.render_json(by_uid(uid))}


def test_provisioning_points_grafana_at_the_dashboards():
    provisioning = ROOT / "ops" / "grafana" / "provisioning"
    providers = yaml.safe_load((provisioning / "dashboards.yaml").read_text())["providers"]
    assert providers[0]["type"] == "file" and providers[0]["options"]["path"]
    datasource = yaml.safe_load((provisioning / "datasource.yaml").read_text())["datasources"][0]
    assert datasource["uid"] == "prometheus" and datasource["type"] == "prometheus"
    assert datasource["url"] == "${PROMETHEUS_URL}"


def test_list_names_every_panel(capsys):
    assert generate.main(["--list"]) == 0
    out = capsys.readouterr().out
    for board in BOARDS:
        assert f"{board['uid']}: {board['title']}" in out
        for panel in panels_of(board):
            assert panel["title"] in out
