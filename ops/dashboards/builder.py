"""Small builders for Grafana dashboard JSON (schemaVersion 39: Grafana 10 and 11).

Plain dicts in the shape Grafana itself saves, so a generated file diffs cleanly against an export
from the UI and needs no library to read. Panels are made without a position or id; `dashboard()`
numbers them in order and lays them out row by row, left to right, so ids and positions are stable
for as long as the panel list is.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 39
GRID_WIDTH = 24

# Every query goes to the data source the dashboard's `datasource` variable picks, so one file works
# with whatever the Prometheus data source is called in a given Grafana.
DATASOURCE_VARIABLE = "datasource"
DATASOURCE = {"type": "prometheus", "uid": "${" + DATASOURCE_VARIABLE + "}"}

Json = dict[str, Any]


@dataclass(frozen=True)
class Query:
    """One PromQL query of a panel; `legend` is Grafana's legend template (`{{model}}`)."""

    expr: str
    legend: str


@dataclass(frozen=True)
class State:
    """How a state-timeline shows one numeric value of a gauge that encodes a state."""

    value: int
    text: str
    color: str


@dataclass(frozen=True)
class Row:
    """A titled band of panels; `repeat` names a variable to repeat the row (and its panels) for."""

    title: str
    panels: tuple[Json, ...]
    repeat: str | None = None


# ---- targets ------------------------------------------------------------------------------------

def _targets(queries: Sequence[Query], fmt: str = "time_series") -> list[Json]:
    return [
        {
            "datasource": dict(DATASOURCE),
            "editorMode": "code",
            "expr": q.expr,
            "format": fmt,
            "legendFormat": q.legend,
            "range": True,
            "refId": _ref_id(i),
        }
        for i, q in enumerate(queries)
    ]


def _ref_id(index: int) -> str:
    if index >= 26:
        raise ValueError("a panel with more than 26 queries is too busy to read")
    return chr(ord("A") + index)


# ---- panels -------------------------------------------------------------------------------------

def _panel(kind: str, title: str, description: str, targets: list[Json], *, width: int, height: int,
           defaults: Json, options: Json, overrides: Sequence[Json] = ()) -> Json:
    if not description.strip():
        raise ValueError(f"panel {title!r} needs a description: it is the panel's only documentation")
    if not 0 < width <= GRID_WIDTH:
        raise ValueError(f"panel {title!r}: width {width} outside 1..{GRID_WIDTH}")
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": dict(DATASOURCE),
        "gridPos": {"h": height, "w": width},
        "fieldConfig": {"defaults": defaults, "overrides": list(overrides)},
        "options": options,
        "targets": targets,
    }


def _legend(calcs: Sequence[str] = ()) -> Json:
    return {
        "calcs": list(calcs),
        "displayMode": "table" if calcs else "list",
        "placement": "bottom",
        "showLegend": True,
    }


def _thresholds(steps: Sequence[tuple[float | None, str]]) -> Json:
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for value, color in steps]}


_NEUTRAL = ((None, "green"),)


def timeseries(title: str, description: str, queries: Sequence[Query], *, unit: str = "short",
               width: int = 12, height: int = 8, stacked: bool = False, bars: bool = False,
               min_value: float | None = 0, max_value: float | None = None,
               legend_calcs: Sequence[str] = ("mean", "max", "lastNotNull")) -> Json:
    """A time series; `bars` for counts of rare events (`increase`), where a line would suggest a rate."""
    custom = {
        "axisSoftMin": min_value,
        "drawStyle": "bars" if bars else "line",
        "fillOpacity": 60 if bars else (25 if stacked else 10),
        "lineInterpolation": "linear",
        "lineWidth": 1,
        "pointSize": 4,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"group": "A", "mode": "normal" if stacked else "none"},
    }
    defaults: Json = {"color": {"mode": "palette-classic"}, "custom": custom, "unit": unit,
                      "thresholds": _thresholds(_NEUTRAL)}
    if max_value is not None:
        defaults["max"] = max_value
    options = {"legend": _legend(legend_calcs), "tooltip": {"mode": "multi", "sort": "desc"}}
    return _panel("timeseries", title, description, _targets(queries), width=width, height=height,
                  defaults=defaults, options=options)


def stat(title: str, description: str, query: Query, *, unit: str = "short", width: int = 4,
         height: int = 4, thresholds: Sequence[tuple[float | None, str]] = _NEUTRAL,
         decimals: int | None = None) -> Json:
    """One number (the latest value) with a sparkline; thresholds colour it."""
    defaults: Json = {"color": {"mode": "thresholds"}, "unit": unit, "thresholds": _thresholds(thresholds)}
    if decimals is not None:
        defaults["decimals"] = decimals
    options = {
        "colorMode": "value",
        "graphMode": "area",
        "justifyMode": "auto",
        "orientation": "auto",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "textMode": "auto",
    }
    return _panel("stat", title, description, _targets([query]), width=width, height=height,
                  defaults=defaults, options=options)


def state_timeline(title: str, description: str, queries: Sequence[Query], states: Sequence[State], *,
                   width: int = 24, height: int = 6) -> Json:
    """One band per series, coloured by the state its value encodes (a breaker, a rollout phase)."""
    mappings = [{
        "type": "value",
        "options": {str(s.value): {"color": s.color, "index": i, "text": s.text} for i, s in enumerate(states)},
    }]
    defaults: Json = {"color": {"mode": "thresholds"}, "mappings": mappings,
                      "thresholds": _thresholds(_NEUTRAL), "custom": {"fillOpacity": 80, "lineWidth": 0}}
    options = {
        "alignValue": "left",
        "legend": _legend(),
        "mergeValues": True,
        "rowHeight": 0.9,
        "showValue": "auto",
        "tooltip": {"mode": "single", "sort": "none"},
    }
    return _panel("state-timeline", title, description, _targets(queries), width=width, height=height,
                  defaults=defaults, options=options)


def heatmap(title: str, description: str, query: Query, *, unit: str, width: int = 12,
            height: int = 8) -> Json:
    """A histogram's buckets over time; `query` returns per-`le` counts (Grafana de-accumulates them)."""
    options = {
        "calculate": False,
        "cellGap": 1,
        "color": {"exponent": 0.5, "fill": "dark-orange", "mode": "scheme", "reverse": False,
                  "scale": "exponential", "scheme": "Oranges", "steps": 64},
        "filterValues": {"le": 1e-9},
        "legend": {"show": True},
        "rowsFrame": {"layout": "auto"},
        "tooltip": {"mode": "single", "showColorScale": False, "yHistogram": True},
        "yAxis": {"axisPlacement": "left", "unit": unit},
    }
    return _panel("heatmap", title, description, _targets([query], fmt="heatmap"), width=width,
                  height=height, defaults={"custom": {"scaleDistribution": {"type": "linear"}}},
                  options=options)


# ---- template variables -------------------------------------------------------------------------

def datasource_variable() -> Json:
    return {
        "current": {},
        "hide": 0,
        "includeAll": False,
        "label": "Data source",
        "multi": False,
        "name": DATASOURCE_VARIABLE,
        "options": [],
        "query": "prometheus",
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
        "type": "datasource",
    }


def query_variable(name: str, label: str, query: str, *, description: str, multi: bool = True,
                   include_all: bool = True) -> Json:
    """Values from Prometheus (`label_values(...)`), refreshed when the time range changes so a model
    or version that appears mid-session shows up."""
    return {
        "current": {},
        "datasource": dict(DATASOURCE),
        # "All" as a regex rather than the list of values: it stays valid when the list is empty
        # (no traffic yet) or long.
        "allValue": ".*" if include_all else None,
        "definition": query,
        "description": description,
        "hide": 0,
        "includeAll": include_all,
        "label": label,
        "multi": multi,
        "name": name,
        "options": [],
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 2,
        "regex": "",
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }


def custom_variable(name: str, label: str, values: Sequence[str], default: str, *, description: str) -> Json:
    """A fixed list of choices, for example an SLO threshold."""
    if default not in values:
        raise ValueError(f"variable {name}: default {default!r} is not one of {list(values)}")
    return {
        "current": {"selected": True, "text": default, "value": default},
        "description": description,
        "hide": 0,
        "includeAll": False,
        "label": label,
        "multi": False,
        "name": name,
        "options": [{"selected": v == default, "text": v, "value": v} for v in values],
        "query": ",".join(values),
        "skipUrlSync": False,
        "type": "custom",
    }


# ---- dashboards ---------------------------------------------------------------------------------

def dashboard(*, uid: str, title: str, description: str, variables: Sequence[Json], rows: Sequence[Row],
              tags: Sequence[str] = ("shunter",)) -> Json:
    """A whole dashboard: panels numbered 1.. in order and laid out without overlap."""
    return {
        "annotations": {"list": [{
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        }]},
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        # The other dashboards of the same tag, keeping the time range and the chosen variables.
        "links": [{"asDropdown": True, "icon": "external link", "includeVars": True, "keepTime": True,
                   "tags": list(tags), "targetBlank": False, "title": "Shunter dashboards",
                   "type": "dashboards"}],
        "panels": _layout(rows),
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": list(tags),
        "templating": {"list": list(variables)},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }


def _layout(rows: Sequence[Row]) -> list[Json]:
    placed: list[Json] = []
    y = 0
    for row in rows:
        placed.append(_row_panel(row, panel_id=len(placed) + 1, y=y))
        y += 1
        x = line_height = 0
        for panel in row.panels:
            width, height = panel["gridPos"]["w"], panel["gridPos"]["h"]
            if x + width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            laid = copy.deepcopy(panel)
            laid["id"] = len(placed) + 1
            laid["gridPos"] = {"h": height, "w": width, "x": x, "y": y}
            placed.append(laid)
            x += width
            line_height = max(line_height, height)
        y += line_height
    return placed


def _row_panel(row: Row, *, panel_id: int, y: int) -> Json:
    panel: Json = {"collapsed": False, "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}, "id": panel_id,
                   "panels": [], "title": row.title, "type": "row"}
    if row.repeat:
        panel["repeat"] = row.repeat
    return panel


def panels_of(board: Json) -> list[Json]:
    """Every panel of a dashboard, those nested in collapsed rows included."""
    found: list[Json] = []
    for panel in board["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found
