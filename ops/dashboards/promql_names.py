"""The metric names a dashboard's PromQL reads, so tests can hold every panel to the metric catalog.

A typo'd metric name is not an error to Prometheus or Grafana: the panel just shows "No data",
forever. Parsing each expression (rather than matching names with a regex) also proves it is valid
PromQL once Grafana has put its variables in.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import promql_parser

# What Grafana puts in for its own variables; any valid duration parses the same.
BUILTIN_VALUES = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}

# A dashboard variable stands for label values, so it may only appear inside a matcher's string,
# where a regex matching anything is valid whatever the matcher.
ANY_VALUE = ".*"

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
ALLOW_LIST = Path(__file__).resolve().parents[1] / "grafana" / "allowed_external_metrics.txt"

_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(?P<selector>.+),)?\s*(?P<label>\w+)\s*\)\s*$")


def interpolate(expr: str, values: Mapping[str, str] | None = None) -> str:
    """`expr` as Grafana would send it: built-in intervals as durations, `values[name]` for the named
    variables (for example an SLO variable's option, which must be a real bucket boundary), and
    `.*` for any other variable. An unknown `$__` name is a typo Grafana would send unreplaced."""
    chosen = dict(values or {})

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name.startswith("__"):
            if name not in BUILTIN_VALUES:
                raise ValueError(f"unknown Grafana built-in variable ${name} in {expr!r}")
            return BUILTIN_VALUES[name]
        return chosen.get(name, ANY_VALUE)

    return _VARIABLE.sub(replace, expr)


def metric_names(expr: str, values: Mapping[str, str] | None = None) -> set[str]:
    """Every metric name `expr` selects; raises ValueError if it is not valid PromQL once interpolated."""
    return set(_names(promql_parser.parse(interpolate(expr, values))))


def variable_query_metric_names(query: str, values: Mapping[str, str] | None = None) -> set[str]:
    """Metric names in a template variable's query: `label_values(selector, label)` (the selector is
    PromQL), `label_values(label)` (none), or a plain PromQL query."""
    found = _LABEL_VALUES.match(query)
    if found is None:
        return metric_names(query, values)
    selector = found.group("selector")
    return metric_names(selector, values) if selector else set()


def slo_values(board: Mapping) -> dict[str, str]:
    """Custom variables (the SLO thresholds) at their first option, as Grafana could send them."""
    return {v["name"]: v["options"][0]["value"] for v in board["templating"]["list"] if v["type"] == "custom"}


def dashboard_metric_names(board: Mapping) -> set[str]:
    """Every metric name a dashboard's panels and template variables query."""
    from shunter.ops.dashboards.builder import panels_of

    used: set[str] = set()
    for panel in panels_of(dict(board)):
        for target in panel.get("targets", []):
            used |= metric_names(target["expr"], slo_values(board))
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            used |= variable_query_metric_names(variable["query"]["query"])
    return used


def allowed_external_metrics(path: Path = ALLOW_LIST) -> dict[str, str]:
    """The allow-list of non-Shunter metrics dashboards may use (Ray Serve's, vLLM's, pinned versions),
    as name -> reason."""
    entries = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, _, reason = line.partition("#")
        entries[name.strip()] = reason.strip()
    return entries


def base_name(name: str) -> str:
    """The histogram a `_bucket`/`_sum`/`_count` series belongs to; any other name as it is (Shunter's
    counters keep their `_total`). Only meaningful for names known to be a histogram's series."""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _names(node: object) -> Iterator[str]:
    if isinstance(node, promql_parser.VectorSelector):
        yield _selector_name(node)
        return
    for child in _children(node):
        yield from _names(child)


def _children(node: object) -> tuple[object, ...]:
    if isinstance(node, promql_parser.MatrixSelector):
        # promql-parser 0.12 names it `vector_selector`; older releases `vs`.
        return (getattr(node, "vector_selector", None) or node.vs,)
    if isinstance(node, promql_parser.Call):
        return tuple(node.args)
    if isinstance(node, promql_parser.AggregateExpr):
        return (node.expr,) if node.param is None else (node.expr, node.param)
    if isinstance(node, promql_parser.BinaryExpr):
        return (node.lhs, node.rhs)
    if isinstance(node, promql_parser.ParenExpr | promql_parser.SubqueryExpr | promql_parser.UnaryExpr):
        return (node.expr,)
    if isinstance(node, promql_parser.NumberLiteral | promql_parser.StringLiteral):
        return ()
    # A node kind this walk does not know could hide a selector: better to fail than to under-report.
    raise TypeError(f"unexpected PromQL node {type(node).__name__}")


def _selector_name(selector: promql_parser.VectorSelector) -> str:
    if selector.name:
        return selector.name
    if selector.matchers.or_matchers:
        raise ValueError(f"selector with `or` matchers: {selector}")
    for matcher in selector.matchers.matchers:
        if matcher.name == "__name__" and matcher.op == promql_parser.MatchOp.Equal:
            return matcher.value
    raise ValueError(f"selector without a literal metric name: {selector}")
