"""Draw a Grafana dashboard's panels to one PNG, from a real Prometheus instead of a Grafana server.

Each chosen panel's queries are interpolated (dashboard variables, `$__rate_interval`, as Grafana does)
and sent to Prometheus as range queries over the run's span (`shunter.cli.demo.prometheus`), then drawn with
matplotlib: time series as lines,
stat and gauge panels as their reduced value over a faint sparkline, bar gauges as horizontal bars.
The result is an approximation of what Grafana would show, good enough for a README screenshot and
for seeing at a glance that the dashboards' queries return data; it is not a Grafana clone.

matplotlib's object API (`Figure`, no pyplot) is used so no global backend is chosen or changed, and
rendering works on headless hosts and from any thread.
"""

from __future__ import annotations

import json
import logging
import math
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from shunter.cli.demo.panels.variables import format_duration, grafana_rate_interval, interpolate

log = logging.getLogger(__name__)

RENDERED_TYPES = ("timeseries", "stat", "gauge", "bargauge")
COLUMNS = 3
MAX_LEGEND_ENTRIES = 8
PANEL_SIZE_IN = (5.4, 3.6)
DPI = 110

Variables = Mapping[str, str | Sequence[str]]


class RangeSource(Protocol):
    """Where range queries go: a `shunter.cli.demo.prometheus.Prometheus`."""

    scrape_interval_s: float

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]: ...


@dataclass
class PanelData:
    """A panel's evaluated queries: one line of values per result series, aligned to the step grid."""

    title: str
    type: str
    unit: str
    reducer: str
    limits: tuple[float | None, float | None]
    lines: list[tuple[str, list[float]]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def has_data(self) -> bool:
        return any(not math.isnan(v) for _, values in self.lines for v in values)


# ---- entry points ---------------------------------------------------------------------------------


def render_dashboard(dashboard_json: Mapping[str, Any], source: RangeSource, out_png: Path, start: float,
                     end: float, panel_titles: Sequence[str] | None = None, variables: Variables | None = None,
                     step_s: float = 2.0, rate_interval: str | None = None) -> Path:
    """Render the dashboard's panels (or only `panel_titles`, in that order) over [start, end] to `out_png`.

    Variables default to the dashboard's own current values ("All" where none is set); `variables`
    overrides them. `rate_interval` defaults to what Grafana would compute for the source's scrape
    interval. A panel whose queries fail or return nothing says so in its box; only a title that is
    not on the dashboard raises (ValueError), since that is a mistake in the caller's selection.
    """
    dashboard = _unwrap(dashboard_json)
    panels = select_panels(dashboard, panel_titles)
    grid = step_times(start, end, step_s)
    values = {**dashboard_variables(dashboard), **(variables or {})}
    rate = rate_interval or grafana_rate_interval(source.scrape_interval_s, step_s)
    span = format_duration(grid[-1] - grid[0]) if len(grid) > 1 else rate
    data = [evaluate_panel(panel, source, grid, step_s, values, rate, span) for panel in panels]
    _draw(dashboard.get("title", dashboard.get("uid", "dashboard")), data, grid, Path(out_png))
    return Path(out_png)


def render_all(dashboards_dir: Path, source: RangeSource, out_dir: Path, start: float, end: float,
               selection: Mapping[str, Sequence[str] | None] | None = None,
               variables: Variables | None = None, step_s: float = 2.0,
               rate_interval: str | None = None) -> list[Path]:
    """Render each selected dashboard (uid -> panel titles, None for all panels) to `out_dir/<uid>.png`.

    Without a selection every dashboard in `dashboards_dir` is rendered whole.
    """
    dashboards = load_dashboards(Path(dashboards_dir))
    chosen = selection if selection is not None else dict.fromkeys(dashboards)
    unknown = sorted(set(chosen) - set(dashboards))
    if unknown:
        raise ValueError(f"no dashboard with uid {unknown} in {dashboards_dir}; found {sorted(dashboards)}")
    return [render_dashboard(dashboards[uid], source, Path(out_dir) / f"{uid}.png", start, end, titles, variables,
                             step_s, rate_interval=rate_interval)
            for uid, titles in chosen.items()]


def step_times(start: float, end: float, step_s: float) -> list[float]:
    """The instants a range query evaluates at: start, start + step, ... up to end, on whole
    milliseconds (Prometheus's resolution), so its answers match the grid exactly."""
    first = round(start, 3)
    count = int((end - first) // step_s) + 1 if end >= first else 0
    return [round(first + i * step_s, 3) for i in range(count)]


def load_dashboards(dashboards_dir: Path) -> dict[str, dict[str, Any]]:
    """Every `*.json` dashboard in the folder, by uid (the file's stem when it has none)."""
    dashboards = {}
    for path in sorted(dashboards_dir.glob("*.json")):
        dashboard = _unwrap(json.loads(path.read_text()))
        dashboards[dashboard.get("uid") or path.stem] = dashboard
    return dashboards


def _unwrap(dashboard_json: Mapping[str, Any]) -> Mapping[str, Any]:
    """Accept the API's `{"dashboard": {...}}` envelope as well as a bare dashboard."""
    inner = dashboard_json.get("dashboard")
    return inner if isinstance(inner, Mapping) else dashboard_json


# ---- panel selection and variables ------------------------------------------------------------------------


def select_panels(dashboard: Mapping[str, Any], titles: Sequence[str] | None) -> list[Mapping[str, Any]]:
    """The drawable panels, including those inside collapsed rows; by title when titles are given."""
    drawable = [p for p in _all_panels(dashboard.get("panels", [])) if p.get("type") in RENDERED_TYPES]
    if titles is None:
        return drawable
    by_title = {p.get("title"): p for p in drawable}
    missing = [t for t in titles if t not in by_title]
    if missing:
        raise ValueError(f"dashboard {dashboard.get('uid')!r} has no drawable panel titled {missing}; "
                         f"it has {sorted(str(t) for t in by_title)}")
    return [by_title[t] for t in titles]


def _all_panels(panels: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Flatten rows: a collapsed row carries its panels inside itself, an open one after itself."""
    flat = []
    for panel in panels:
        flat.append(panel)
        flat.extend(_all_panels(panel.get("panels", [])))
    return flat


def dashboard_variables(dashboard: Mapping[str, Any]) -> dict[str, str | list[str]]:
    """Each templating variable's saved current value; "All" (or its custom all-value) when unset.

    Without a Grafana there is nobody to run a variable's query for its options, so an unset
    variable means "everything", which is what a demo over all models wants anyway.
    """
    values: dict[str, str | list[str]] = {}
    for variable in dashboard.get("templating", {}).get("list", []):
        name = variable.get("name")
        if not name or variable.get("type") == "datasource":
            continue
        current = (variable.get("current") or {}).get("value")
        if current in (None, "", []) or current == "$__all" or current == ["$__all"]:
            current = variable.get("allValue") or "All"
        values[name] = current
    return values


# ---- evaluation ---------------------------------------------------------------------------------------------


def evaluate_panel(panel: Mapping[str, Any], source: RangeSource, grid: Sequence[float], step_s: float,
                   variables: Variables, rate_interval: str, range_: str) -> PanelData:
    """Evaluate every visible target of the panel; a failing target is recorded, not raised."""
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    calcs = panel.get("options", {}).get("reduceOptions", {}).get("calcs") or ["lastNotNull"]
    data = PanelData(title=display_title(str(panel.get("title", "")), variables), type=str(panel.get("type")),
                     unit=str(defaults.get("unit") or "short"), reducer=str(calcs[0]),
                     limits=(defaults.get("min"), defaults.get("max")))
    for target in panel.get("targets", []):
        if target.get("hide") or not target.get("expr"):
            continue
        try:
            data.lines.extend(_evaluate_target(target, source, grid, step_s, variables, rate_interval, range_))
        except Exception as exc:  # one broken query must not cost the render its other panels
            log.warning("panel %r, query %s failed: %s", data.title, target.get("refId", "?"), exc)
            data.errors.append(f"{target.get('refId', '?')}: {exc}")
    return data


_TITLE_VARIABLE = re.compile(r"\$\{(\w+)(?::[\w-]+)?\}|\$(\w+)")


def display_title(title: str, variables: Variables) -> str:
    """The title as Grafana shows it: variables replaced by their plain values (unknown ones kept)."""

    def value(match: re.Match[str]) -> str:
        current = variables.get(match.group(1) or match.group(2))
        if current is None:
            return match.group(0)
        return current if isinstance(current, str) else ", ".join(current)

    return _TITLE_VARIABLE.sub(value, title)


def _evaluate_target(target: Mapping[str, Any], source: RangeSource, grid: Sequence[float], step_s: float,
                     variables: Variables, rate_interval: str, range_: str) -> list[tuple[str, list[float]]]:
    expr = interpolate(target["expr"], variables, rate_interval, interval=format_duration(step_s),
                       range_=range_)
    if not grid:
        return []
    series = source.query_range(expr, grid[0], grid[-1], step_s)
    return [(legend(target.get("legendFormat"), s.get("metric", {}), expr), _on_grid(s.get("values", []), grid))
            for s in series]


def _on_grid(points: Sequence[Sequence[Any]], grid: Sequence[float]) -> list[float]:
    """One value per grid step, NaN where the series had none, so the line shows a gap there.

    Prometheus evaluated the query at exactly these steps (on whole milliseconds), so matching by the
    millisecond is exact.
    """
    by_ms = {round(float(t) * 1000): float(v) for t, v in points}
    return [by_ms.get(round(t * 1000), math.nan) for t in grid]


_LEGEND_LABEL = re.compile(r"\{\{\s*(.+?)\s*\}\}")


def legend(legend_format: str | None, labels: Mapping[str, str], expr: str) -> str:
    """Grafana's legend: `{{label}}` replaced by the label's value (empty when absent); with no format
    (or `__auto`), the series' labels as `name{k="v"}`, or the query when it has none."""
    if legend_format and legend_format != "__auto":
        return _LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), legend_format)
    name = labels.get("__name__", "")
    rest = ", ".join(f'{k}="{v}"' for k, v in labels.items() if k != "__name__")
    if not name and not rest:
        return textwrap.shorten(expr, 60)
    return f"{name}{{{rest}}}" if rest else name


# ---- units --------------------------------------------------------------------------------------------------

_RATE_SUFFIXES = {"reqps": "req/s", "ops": "ops/s", "rps": "rd/s", "wps": "wr/s", "cps": "c/s"}


def format_value(value: float, unit: str) -> str:
    """A value as Grafana would label it for the panel's unit (the common units; others get a suffix)."""
    if math.isnan(value):
        return "NaN"
    if unit in ("s", "ms"):
        return _duration(value / 1000 if unit == "ms" else value)
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    if unit == "percent":
        return f"{value:.3g}%"
    if unit in _RATE_SUFFIXES:
        return f"{_short(value)} {_RATE_SUFFIXES[unit]}"
    if unit in ("bytes", "decbytes"):
        return _bytes(value, 1024 if unit == "bytes" else 1000)
    if unit.startswith("suffix:"):
        return f"{_short(value)}{unit[len('suffix:'):]}"
    if unit in ("short", "none", ""):
        return _short(value)
    return f"{_short(value)} {unit}"


def _duration(seconds: float) -> str:
    size = abs(seconds)
    if size == 0 or math.isinf(size):
        return f"{seconds:g} s"
    for limit, scale, name in ((1e-3, 1e6, "µs"), (1.0, 1e3, "ms"), (60.0, 1.0, "s"), (3600.0, 1 / 60, "min")):
        if size < limit:
            return f"{seconds * scale:.3g} {name}"
    return f"{seconds / 3600:.3g} h"


def _short(value: float) -> str:
    """SI-style prefixes (k, M, G, T) above a thousand, three significant digits."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor and not math.isinf(value):
            return f"{value / factor:.3g}{prefix}"
    return f"{value:.3g}"


def _bytes(value: float, base: int) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB") if base == 1024 else ("B", "kB", "MB", "GB", "TB")
    for power, name in reversed(list(enumerate(units))):
        if abs(value) >= base**power or power == 0:
            return f"{value / base**power:.3g} {name}"
    return f"{value:g} B"


# ---- reduction (stat, gauge, bargauge) ----------------------------------------------------------------------

_REDUCERS: dict[str, Callable[[list[float]], float]] = {
    "lastNotNull": lambda vs: vs[-1],
    "last": lambda vs: vs[-1],
    "firstNotNull": lambda vs: vs[0],
    "first": lambda vs: vs[0],
    "mean": lambda vs: math.fsum(vs) / len(vs),
    "max": max,
    "min": min,
    "sum": math.fsum,
    "count": lambda vs: float(len(vs)),
}


def reduce_values(values: Sequence[float], reducer: str) -> float:
    """A stat panel's single number from a line (NaNs skipped); unknown reducers fall back to last."""
    real = [v for v in values if not math.isnan(v)]
    if not real:
        return math.nan
    return _REDUCERS.get(reducer, _REDUCERS["lastNotNull"])(real)


# ---- drawing ------------------------------------------------------------------------------------------------


def _draw(title: str, panels: Sequence[PanelData], grid: Sequence[float], out_png: Path) -> None:
    from matplotlib.figure import Figure  # deferred: matplotlib costs ~0.5 s to import

    count = max(1, len(panels))
    cols = min(COLUMNS, count)
    rows = math.ceil(count / cols)
    # constrained layout leaves room for the two-line suptitle, which tight_layout would overlap
    fig = Figure(figsize=(PANEL_SIZE_IN[0] * cols, PANEL_SIZE_IN[1] * rows + 0.6), layout="constrained")
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    x = [t - grid[0] for t in grid]
    for ax, panel in zip(axes, panels, strict=False):
        _draw_panel(ax, panel, x)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{title}\n{_span_text(grid)}", fontsize=13)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=DPI)


def _span_text(grid: Sequence[float]) -> str:
    if not grid:
        return "no scrapes"
    start, end = (datetime.fromtimestamp(t, tz=UTC) for t in (grid[0], grid[-1]))
    return f"{start:%Y-%m-%d %H:%M:%S} to {end:%H:%M:%S} UTC ({grid[-1] - grid[0]:.0f} s)"


def _draw_panel(ax: Any, panel: PanelData, x: Sequence[float]) -> None:
    ax.set_title(panel.title, fontsize=10)
    if not panel.has_data():
        message = f"query error\n{_wrap(panel.errors[0])}" if panel.errors else "no data"
        _message(ax, message, color="#b00020" if panel.errors else "#666666")
        return
    if panel.type == "bargauge":
        _draw_bars(ax, panel)
    elif panel.type in ("stat", "gauge"):
        _draw_stat(ax, panel, x)
    else:
        _draw_lines(ax, panel, x)
    if panel.errors:
        failed = f"{len(panel.errors)} {'query' if len(panel.errors) == 1 else 'queries'} failed"
        ax.text(0.01, 0.01, failed, transform=ax.transAxes, fontsize=7, color="#b00020", va="bottom")


def _draw_lines(ax: Any, panel: PanelData, x: Sequence[float]) -> None:
    from matplotlib.ticker import FuncFormatter

    for label, values in panel.lines:
        ax.plot(x, values, label=label, linewidth=1.4)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_value(v, panel.unit)))
    low, high = panel.limits
    if low is not None or high is not None:
        ax.set_ylim(bottom=low, top=high)
    ax.set_xlabel("seconds since start", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles[:MAX_LEGEND_ENTRIES], labels[:MAX_LEGEND_ENTRIES], fontsize=7, loc="upper left")


def _draw_stat(ax: Any, panel: PanelData, x: Sequence[float]) -> None:
    """The reduced value(s) in large type over faint sparklines, as a stat panel shows them."""
    for _, values in panel.lines:
        ax.plot(x, values, linewidth=1.0, alpha=0.25)
    ax.set_xticks([])
    ax.set_yticks([])
    shown = panel.lines[:4]
    for row, (label, values) in enumerate(shown):
        text = format_value(reduce_values(values, panel.reducer), panel.unit)
        if len(shown) > 1:
            text = f"{_wrap(label, 30)}: {text}"
        y = 0.5 if len(shown) == 1 else 0.8 - row * 0.2
        ax.text(0.5, y, text, transform=ax.transAxes, ha="center", va="center",
                fontsize=22 if len(shown) == 1 else 11, fontweight="bold")


def _draw_bars(ax: Any, panel: PanelData) -> None:
    lines = panel.lines[:MAX_LEGEND_ENTRIES]
    values = [reduce_values(v, panel.reducer) for _, v in lines]
    positions = list(range(len(lines)))
    ax.barh(positions, [0.0 if math.isnan(v) else v for v in values], color="#3274d9")
    ax.set_yticks(positions, [_wrap(label, 24) for label, _ in lines], fontsize=7)
    ax.invert_yaxis()
    ax.tick_params(axis="x", labelsize=7)
    for position, value in zip(positions, values, strict=True):
        ax.text(0.0 if math.isnan(value) else value, position, " " + format_value(value, panel.unit),
                va="center", fontsize=8)


def _message(ax: Any, text: str, color: str) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=10, color=color)


def _wrap(text: str, width: int = 50) -> str:
    return "\n".join(textwrap.wrap(text, width)[:4]) or text
