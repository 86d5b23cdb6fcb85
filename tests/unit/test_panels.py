"""Grafana's side of panel rendering, without Prometheus: variable interpolation, the dashboards'
saved variable values, legends, titles and units. Prometheus's answers and the PNGs they make are tested
against a real Prometheus (tests/integration/test_prometheus.py)."""

from __future__ import annotations

import pytest

from shunter.cli.demo.panels.render import (
    dashboard_variables,
    display_title,
    format_value,
    legend,
    step_times,
)
from shunter.cli.demo.panels.variables import VariableError, grafana_rate_interval, interpolate

# ---- Grafana variables ------------------------------------------------------------------------------------


def test_interpolation_of_grafana_variables():
    expr = ('sum(rate(x{model=~"$model",version="${version}"}[$__rate_interval])) '
            '/ $__range_s + label_replace(y, "d", "$1", "s", "(.*)")[$__interval]')
    assert interpolate(expr, {"model": "All", "version": "v2"}, rate_interval="8s", interval="2s",
                       range_="5m") == ('sum(rate(x{model=~".*",version="v2"}[8s])) '
                                        '/ 300 + label_replace(y, "d", "$1", "s", "(.*)")[2s]')
    assert interpolate('x{m=~"$model"}', {"model": ["a", "b"]}) == 'x{m=~"(a|b)"}'
    assert interpolate('x{m=~"${model:regex}"}[$__rate_interval]', {"model": "$__all"}) == 'x{m=~".*"}[1m]'
    with pytest.raises(VariableError, match="nomodel"):
        interpolate('x{m="$nomodel"}', {})


def test_dashboard_variables_default_to_all():
    dashboard = {"templating": {"list": [
        {"name": "model", "type": "query", "includeAll": True, "current": {"value": "$__all"}},
        {"name": "version", "type": "custom", "current": {"value": "v1"}},
        {"name": "node", "type": "query", "includeAll": True, "allValue": ".+", "current": {}},
        {"name": "ds", "type": "datasource", "current": {"value": "prometheus"}},
    ]}}
    assert dashboard_variables(dashboard) == {"model": "All", "version": "v1", "node": ".+"}


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


def test_the_query_grid_is_on_whole_milliseconds_and_grafanas_rate_interval():
    assert step_times(100.0004, 106, 2) == [100.0, 102.0, 104.0, 106.0]
    assert step_times(10, 9, 1) == []
    assert grafana_rate_interval(2.0, 2.0) == "8s"  # four scrapes
    assert grafana_rate_interval(15.0, 60.0) == "75s"  # a step plus a scrape
