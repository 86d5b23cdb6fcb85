"""A PromQL evaluator for the subset Shunter's dashboards use, over an in-memory `SampleStore`.

`make demo` renders dashboard panels without a Prometheus server, so the dashboards' own queries are
evaluated here: `promql_parser` builds the syntax tree, and this module walks it at one instant
(`evaluate_instant`) or at every step of a range (`evaluate_range`), the way Prometheus's range
queries are just instant queries repeated per step.

Semantics follow Prometheus where they matter for panels (lookback, label matching, which operations
drop the metric name, `histogram_quantile`'s interpolation, division by zero giving Inf/NaN). Known
departures are listed in the package docstring (`shunter.ops.panels`); anything outside the subset raises
`UnsupportedPromQL` naming the construct, never a silently wrong number.
"""

from __future__ import annotations

import bisect
import math
import operator
import re
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import pairwise

import promql_parser as pp

from shunter.ops.panels.scrape import Labels, Point, SampleStore, freeze_labels

LOOKBACK_S = 300.0  # an instant selector sees the latest sample at most this old, as in Prometheus
NAME = "__name__"


class PromQLError(ValueError):
    """A query that cannot be evaluated: bad syntax, wrong argument types, ambiguous vector matching."""


class UnsupportedPromQL(PromQLError):
    """Valid PromQL outside this evaluator's subset; `construct` (and the message) names what it was."""

    def __init__(self, construct: str) -> None:
        super().__init__(f"unsupported PromQL: {construct} (shunter.ops.panels.promql implements a subset)")
        self.construct = construct


@dataclass
class Sample:
    """One element of an instant query's result."""

    labels: dict[str, str]
    value: float


@dataclass
class Series:
    """One series of a range query's result: a point for every step at which the series had a value."""

    labels: dict[str, str]
    points: list[tuple[float, float]]


class _Vector(dict[Labels, float]):
    """An instant vector: label set (metric name included as `__name__`) -> value."""


class _Matrix(dict[Labels, list[Point]]):
    """A range vector: label set -> the samples inside the window, which is `range_s` long."""

    def __init__(self, range_s: float) -> None:
        super().__init__()
        self.range_s = range_s


Value = float | str | _Vector | _Matrix


# ---- public entry points ------------------------------------------------------------------------


def parse(expr: str) -> pp.Expr:
    """Parse `expr`, turning the parser's bare ValueError into one that quotes the query."""
    try:
        return pp.parse(expr)
    except ValueError as exc:
        raise PromQLError(f"cannot parse {expr!r}: {exc}") from exc


def evaluate_instant(expr: str | pp.Expr, store: SampleStore, t: float) -> list[Sample]:
    """Evaluate at instant `t`; a scalar result comes back as one sample with no labels."""
    value = _evaluate_at(_ast(expr), _Context(store, t))
    if isinstance(value, float):
        return [Sample({}, value)]
    return [Sample(_as_dict(labels), v) for labels, v in sorted(value.items(), key=_label_order)]


def evaluate_range(expr: str | pp.Expr, store: SampleStore, start: float, end: float,
                   step: float) -> list[Series]:
    """Evaluate at `start`, `start + step`, ... up to `end`, and collect the results per series.

    A series missing at some step simply has no point there (Prometheus's behaviour); the renderer
    turns those holes into gaps.
    """
    if step <= 0:
        raise ValueError(f"step must be positive, got {step}")
    ast = _ast(expr)
    context = _Context(store, start)
    collected: dict[Labels, list[Point]] = {}
    for t in step_times(start, end, step):
        context.t = t
        value = _evaluate_at(ast, context)
        if isinstance(value, float):
            value = _Vector({frozenset(): value})
        for labels, v in value.items():
            collected.setdefault(labels, []).append((t, v))
    return [Series(_as_dict(labels), points) for labels, points in sorted(collected.items(), key=_label_order)]


def step_times(start: float, end: float, step: float) -> list[float]:
    """The evaluation instants of a range query; computed by multiplication so they never drift."""
    if end < start:
        return []
    count = int(math.floor((end - start) / step + 1e-9)) + 1
    return [start + k * step for k in range(count)]


def _ast(expr: str | pp.Expr) -> pp.Expr:
    return parse(expr) if isinstance(expr, str) else expr


def _label_order(item: tuple[Labels, object]) -> list[tuple[str, str]]:
    return sorted(item[0])


def _as_dict(labels: Labels) -> dict[str, str]:
    """Labels in name order, so legends and test output are the same from run to run."""
    return dict(sorted(labels))


def _evaluate_at(ast: pp.Expr, context: _Context) -> float | _Vector:
    value = _eval(ast, context)
    if isinstance(value, (_Matrix, str)):
        raise PromQLError(f"a query must give an instant vector or a scalar, not a {_kind(value)}")
    return value


# ---- evaluation context -----------------------------------------------------------------------


@dataclass
class _Context:
    """The instant being evaluated, plus per-query copies of the store's series.

    The copies are taken once per query, not once per step: a range query over a few hundred steps
    would otherwise copy every series a few hundred times.
    """

    store: SampleStore
    t: float
    _series: dict[str, dict[Labels, list[Point]]] = field(default_factory=dict)
    _names: list[str] | None = None

    def series(self, name: str) -> dict[Labels, list[Point]]:
        if name not in self._series:
            self._series[name] = self.store.series(name)
        return self._series[name]

    def names(self) -> list[str]:
        if self._names is None:
            self._names = self.store.names()
        return self._names


def _eval(node: pp.Expr, context: _Context) -> Value:
    handler = _HANDLERS.get(type(node))
    if handler is None:
        raise UnsupportedPromQL(f"{type(node).__name__} expressions")
    return handler(node, context)


def _kind(value: Value) -> str:
    if isinstance(value, _Matrix):
        return "range vector"
    if isinstance(value, _Vector):
        return "instant vector"
    return "string" if isinstance(value, str) else "scalar"


def _arg(value: Value, kind: type, where: str) -> Value:
    """`value`, checked to be of the PromQL kind `where` expects (_Vector, _Matrix, float or str)."""
    if not isinstance(value, kind):
        expected = {_Vector: "an instant vector", _Matrix: "a range vector", float: "a scalar", str: "a string"}[kind]
        raise PromQLError(f"{where} expects {expected}, got a {_kind(value)}")
    return value


def _vector_arg(value: Value, where: str) -> _Vector:
    return _arg(value, _Vector, where)  # type: ignore[return-value]


def _matrix_arg(value: Value, where: str) -> _Matrix:
    return _arg(value, _Matrix, where)  # type: ignore[return-value]


def _scalar_arg(value: Value, where: str) -> float:
    return _arg(value, float, where)  # type: ignore[return-value]


def _string_arg(value: Value, where: str) -> str:
    return _arg(value, str, where)  # type: ignore[return-value]


def _drop_name(labels: Labels) -> Labels:
    """Prometheus drops the metric name from anything computed, since it no longer is that metric."""
    return frozenset(pair for pair in labels if pair[0] != NAME)


# ---- leaves: literals and selectors -----------------------------------------------------------------


def _number(node: pp.NumberLiteral, context: _Context) -> float:
    return float(node.val)


def _string(node: pp.StringLiteral, context: _Context) -> str:
    return str(node.val)


def _paren(node: pp.ParenExpr, context: _Context) -> Value:
    return _eval(node.expr, context)


def _unary(node: pp.UnaryExpr, context: _Context) -> Value:
    """Unary minus (a unary plus never reaches the tree)."""
    value = _eval(node.expr, context)
    if isinstance(value, float):
        return -value
    vector = _vector_arg(value, "unary minus")
    return _Vector({_drop_name(labels): -v for labels, v in vector.items()})


def _instant_selector(node: pp.VectorSelector, context: _Context) -> _Vector:
    """Each matching series' latest sample at or before t, if it is within the lookback window."""
    at = context.t - _offset_s(node)
    result = _Vector()
    for labels, points in _matching_series(node, context):
        index = bisect.bisect_right(points, at, key=_time_of)
        if index and points[index - 1][0] > at - LOOKBACK_S:
            result[labels] = points[index - 1][1]
    return result


def _range_selector(node: pp.MatrixSelector, context: _Context) -> _Matrix:
    """Each matching series' samples in the left-open window (t - range, t]."""
    selector = node.vector_selector
    range_s = node.range.total_seconds()
    end = context.t - _offset_s(selector)
    result = _Matrix(range_s)
    for labels, points in _matching_series(selector, context):
        window = points[bisect.bisect_right(points, end - range_s, key=_time_of):
                        bisect.bisect_right(points, end, key=_time_of)]
        if window:
            result[labels] = window
    return result


def _time_of(point: Point) -> float:
    return point[0]


def _offset_s(selector: pp.VectorSelector) -> float:
    if selector.at is not None:
        raise UnsupportedPromQL("the @ modifier")
    return selector.offset.total_seconds() if selector.offset is not None else 0.0


def _matching_series(selector: pp.VectorSelector, context: _Context) -> Iterator[tuple[Labels, list[Point]]]:
    """Series whose labels (with `__name__`) satisfy all matchers of any one `or` group."""
    matchers = selector.matchers
    groups = matchers.or_matchers or [matchers.matchers]
    names = [selector.name] if selector.name else context.names()
    for name in names:
        for labels, points in context.series(name).items():
            full = labels | {(NAME, name)}
            as_dict = dict(full)
            if any(all(_matches(m, as_dict) for m in group) for group in groups):
                yield full, points


def _matches(matcher: pp.Matcher, labels: Mapping[str, str]) -> bool:
    """A missing label matches as the empty string, as in Prometheus (so `x!="a"` selects it)."""
    value = labels.get(matcher.name, "")
    op = matcher.op
    if op == pp.MatchOp.Equal:
        return value == matcher.value
    if op == pp.MatchOp.NotEqual:
        return value != matcher.value
    found = _regex(matcher.value).fullmatch(value) is not None
    if op == pp.MatchOp.Re:
        return found
    if op == pp.MatchOp.NotRe:
        return not found
    raise UnsupportedPromQL(f"label matcher {op}")


@lru_cache(maxsize=256)
def _regex(pattern: str) -> re.Pattern[str]:
    """PromQL regexes are fully anchored; compiled once per pattern, not once per series and step."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise PromQLError(f"invalid regex {pattern!r}: {exc}") from exc


# ---- functions ----------------------------------------------------------------------------------------


def _call(node: pp.Call, context: _Context) -> Value:
    name = node.func.name
    function = _FUNCTIONS.get(name)
    if function is None:
        raise UnsupportedPromQL(f"function {name}()")
    args = [_eval(arg, context) for arg in node.args]
    return function(name, args, context)


def _counter_increase(points: Sequence[Point]) -> float:
    """last - first, adding back the value before each drop: a drop means the counter restarted at 0."""
    total = points[-1][1] - points[0][1]
    for (_, before), (_, after) in pairwise(points):
        if after < before:
            total += before
    return total


def _rate(points: Sequence[Point], range_s: float) -> float | None:
    """Per-second increase over the span the samples cover (no extrapolation to the window's edges)."""
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return _counter_increase(points) / (points[-1][0] - points[0][0])


def _increase(points: Sequence[Point], range_s: float) -> float | None:
    """The rate scaled to the whole window, so that increase == rate * range, as in Prometheus."""
    rate = _rate(points, range_s)
    return None if rate is None else rate * range_s


def _delta(points: Sequence[Point], range_s: float) -> float | None:
    """increase() for gauges: no reset handling."""
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0]) * range_s


def _irate(points: Sequence[Point], range_s: float) -> float | None:
    if len(points) < 2 or points[-1][0] <= points[-2][0]:
        return None
    (t0, v0), (t1, v1) = points[-2], points[-1]
    return (v1 - v0 if v1 >= v0 else v1) / (t1 - t0)


def _idelta(points: Sequence[Point], range_s: float) -> float | None:
    return points[-1][1] - points[-2][1] if len(points) >= 2 else None


def _over_time(reduce: Callable[[list[float]], float]) -> Callable[[Sequence[Point], float], float]:
    return lambda points, range_s: reduce([v for _, v in points])


_RANGE_FUNCTIONS: dict[str, Callable[[Sequence[Point], float], float | None]] = {
    "rate": _rate,
    "increase": _increase,
    "delta": _delta,
    "irate": _irate,
    "idelta": _idelta,
    "avg_over_time": _over_time(lambda vs: math.fsum(vs) / len(vs)),
    "sum_over_time": _over_time(math.fsum),
    "min_over_time": _over_time(lambda vs: _nan_aware(min, vs)),
    "max_over_time": _over_time(lambda vs: _nan_aware(max, vs)),
    "count_over_time": _over_time(lambda vs: float(len(vs))),
    "last_over_time": _over_time(lambda vs: vs[-1]),
}


def _range_function(name: str, args: list[Value], context: _Context) -> _Vector:
    matrix = _matrix_arg(args[0], f"{name}()")
    reduce = _RANGE_FUNCTIONS[name]
    result = _Vector()
    for labels, points in matrix.items():
        value = reduce(points, matrix.range_s)
        if value is not None:
            result[_drop_name(labels)] = value
    return result


def _math(function: Callable[..., float]) -> Callable[[str, list[Value], _Context], _Vector]:
    """An element-wise function of an instant vector and optional scalar arguments (clamp_min...)."""

    def apply(name: str, args: list[Value], context: _Context) -> _Vector:
        vector = _vector_arg(args[0], f"{name}()")
        extra = [_scalar_arg(arg, f"{name}()") for arg in args[1:]]
        return _Vector({_drop_name(labels): _safe(function, v, *extra) for labels, v in vector.items()})

    return apply


def _safe(function: Callable[..., float], *args: float) -> float:
    """Float semantics instead of Python's exceptions: sqrt(-1) is NaN, exp(1000) is +Inf."""
    try:
        return float(function(*args))
    except ValueError:
        return math.nan
    except OverflowError:
        return math.inf


def _clamp(value: float, low: float, high: float) -> float:
    return math.nan if low > high else min(max(value, low), high)


def _integral(function: Callable[..., float]) -> Callable[..., float]:
    """ceil/floor/round pass ±Inf and NaN through, where Python's would raise."""
    return lambda value, *args: function(value, *args) if math.isfinite(value) else value


def _round(value: float, to_nearest: float = 1.0) -> float:
    """Half rounds up (Prometheus's rule), unlike Python's round-half-to-even."""
    return math.floor(value / to_nearest + 0.5) * to_nearest


def _log(base: float) -> Callable[[float], float]:
    return lambda value: math.log(value, base) if value > 0 else (-math.inf if value == 0 else math.nan)


def _vector_fn(name: str, args: list[Value], context: _Context) -> _Vector:
    return _Vector({frozenset(): _scalar_arg(args[0], "vector()")})


def _scalar_fn(name: str, args: list[Value], context: _Context) -> float:
    vector = _vector_arg(args[0], "scalar()")
    return next(iter(vector.values())) if len(vector) == 1 else math.nan


def _time_fn(name: str, args: list[Value], context: _Context) -> float:
    return context.t


def _label_replace(name: str, args: list[Value], context: _Context) -> _Vector:
    """label_replace(v, dst, replacement, src, regex): `$1`/`${name}` refer to the regex's groups."""
    vector = _vector_arg(args[0], "label_replace()")
    dst, replacement, src, pattern = (_string_arg(arg, "label_replace()") for arg in args[1:5])
    regex = _regex(pattern)
    result = _Vector()
    for labels, value in vector.items():
        as_dict = dict(labels)
        match = regex.fullmatch(as_dict.get(src, ""))
        if match is not None:
            new = _expand(replacement, match)
            if new:
                as_dict[dst] = new
            else:
                as_dict.pop(dst, None)
        result[freeze_labels(as_dict)] = value
    return result


def _expand(template: str, match: re.Match[str]) -> str:
    """Go-style `$1`, `${1}`, `$name` expansion; an unknown group expands to nothing, as in Go."""

    def group(ref: re.Match[str]) -> str:
        key = ref.group(1) or ref.group(2)
        try:
            return match.group(int(key) if key.isdigit() else key) or ""
        except IndexError:
            return ""

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", group, template)


def _histogram_quantile(name: str, args: list[Value], context: _Context) -> _Vector:
    """Groups the `_bucket` series by their labels minus `le`, then interpolates in each group."""
    phi = _scalar_arg(args[0], "histogram_quantile()")
    vector = _vector_arg(args[1], "histogram_quantile()")
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for labels, count in vector.items():
        as_dict = dict(labels)
        as_dict.pop(NAME, None)
        bound = _parse_le(as_dict.pop("le", None))
        if bound is not None:
            groups.setdefault(freeze_labels(as_dict), []).append((bound, count))
    return _Vector({labels: bucket_quantile(phi, buckets) for labels, buckets in groups.items()})


def _parse_le(le: str | None) -> float | None:
    if le is None:
        return None
    try:
        return float(le)
    except ValueError:
        return None


def bucket_quantile(phi: float, buckets: Sequence[tuple[float, float]]) -> float:
    """The φ-quantile of cumulative buckets [(upper bound, count)], the way Prometheus computes it.

    Linear interpolation inside the bucket holding the rank, assuming observations spread evenly; the
    lowest bucket starts at 0 (unless its bound is <= 0); a rank in the +Inf bucket returns the highest
    finite bound. NaN without a +Inf bucket or without observations. Counts that decrease with the
    bound (scrapes racing increments) are raised to keep the sequence monotonic.
    """
    if math.isnan(phi):
        return math.nan
    if phi < 0:
        return -math.inf
    if phi > 1:
        return math.inf
    bounds, counts = _merge_buckets(buckets)
    if len(bounds) < 2 or bounds[-1] != math.inf:
        return math.nan
    total = counts[-1]
    if not total > 0:
        return math.nan
    rank = phi * total
    b = bisect.bisect_left(counts, rank)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = bounds[b - 1] if b > 0 else 0.0
    below = counts[b - 1] if b > 0 else 0.0
    in_bucket = counts[b] - below
    if in_bucket <= 0:
        return start
    return start + (bounds[b] - start) * (rank - below) / in_bucket


def _merge_buckets(buckets: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Sorted bounds and monotonic cumulative counts; duplicate bounds (e.g. `1` and `1.0`) are summed."""
    merged: dict[float, float] = {}
    for bound, count in buckets:
        merged[bound] = merged.get(bound, 0.0) + count
    bounds = sorted(merged)
    counts: list[float] = []
    for bound in bounds:
        counts.append(max(merged[bound], counts[-1]) if counts else merged[bound])
    return bounds, counts


_FUNCTIONS: dict[str, Callable[[str, list[Value], _Context], Value]] = {
    **{name: _range_function for name in _RANGE_FUNCTIONS},
    "histogram_quantile": _histogram_quantile,
    "abs": _math(abs),
    "ceil": _math(_integral(math.ceil)),
    "floor": _math(_integral(math.floor)),
    "round": _math(_integral(_round)),
    "sqrt": _math(math.sqrt),
    "exp": _math(math.exp),
    "ln": _math(_log(math.e)),
    "log2": _math(_log(2.0)),
    "log10": _math(_log(10.0)),
    "clamp": _math(_clamp),
    "clamp_min": _math(lambda v, low: max(v, low) if not math.isnan(v) else v),
    "clamp_max": _math(lambda v, high: min(v, high) if not math.isnan(v) else v),
    "vector": _vector_fn,
    "scalar": _scalar_fn,
    "time": _time_fn,
    "label_replace": _label_replace,
}


# ---- aggregations ---------------------------------------------------------------------------------------


def _nan_aware(pick: Callable[[list[float]], float], values: list[float]) -> float:
    """min/max ignore NaN unless every value is NaN, as Prometheus's min and max do."""
    real = [v for v in values if not math.isnan(v)]
    return pick(real) if real else math.nan


def _quantile(phi: float, values: list[float]) -> float:
    """The φ-quantile of plain values, interpolating between the closest ranks (quantile())."""
    if math.isnan(phi) or not values:
        return math.nan
    if phi < 0 or phi > 1:
        return -math.inf if phi < 0 else math.inf
    ordered = sorted(values)
    rank = phi * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


_REDUCERS: dict[str, Callable[[list[float]], float]] = {
    "sum": math.fsum,
    "avg": lambda vs: math.fsum(vs) / len(vs),
    "min": lambda vs: _nan_aware(min, vs),
    "max": lambda vs: _nan_aware(max, vs),
    "count": lambda vs: float(len(vs)),
    "group": lambda vs: 1.0,
    "stddev": lambda vs: statistics.pstdev(vs),
    "stdvar": lambda vs: statistics.pvariance(vs),
}


def _aggregate(node: pp.AggregateExpr, context: _Context) -> _Vector:
    op = str(node.op)
    vector = _vector_arg(_eval(node.expr, context), f"{op}()")
    key = _grouping(node.modifier)
    groups: dict[Labels, list[tuple[Labels, float]]] = {}
    for labels, value in vector.items():
        groups.setdefault(key(labels), []).append((labels, value))
    if op in ("topk", "bottomk"):
        count = _scalar_arg(_eval(node.param, context), f"{op}()")
        return _select_k(groups, int(count), largest=op == "topk")
    if op == "quantile":
        phi = _scalar_arg(_eval(node.param, context), "quantile()")
        return _Vector({k: _quantile(phi, [v for _, v in members]) for k, members in groups.items()})
    reduce = _REDUCERS.get(op)
    if reduce is None:
        raise UnsupportedPromQL(f"aggregation {op}()")
    return _Vector({k: reduce([v for _, v in members]) for k, members in groups.items()})


def _grouping(modifier: pp.AggModifier | None) -> Callable[[Labels], Labels]:
    """The output label set of each input series: `by` keeps the listed labels, `without` drops them."""
    if modifier is None:
        return lambda labels: frozenset()
    names = set(modifier.labels)
    if modifier.type == pp.AggModifierType.By:
        return lambda labels: frozenset(pair for pair in labels if pair[0] in names)
    names.add(NAME)
    return lambda labels: frozenset(pair for pair in labels if pair[0] not in names)


def _select_k(groups: dict[Labels, list[tuple[Labels, float]]], k: int, largest: bool) -> _Vector:
    """topk/bottomk: the k extreme series of each group, keeping their full labels; NaN ranks last."""
    result = _Vector()
    sign = -1.0 if largest else 1.0
    for members in groups.values():
        ranked = sorted(members, key=lambda m: (math.isnan(m[1]), sign * m[1] if not math.isnan(m[1]) else 0))
        result.update(ranked[:max(k, 0)])
    return result


# ---- binary operators -----------------------------------------------------------------------------------


def _divide(a: float, b: float) -> float:
    """IEEE division: x/0 is ±Inf and 0/0 NaN, where Python would raise."""
    try:
        return a / b
    except ZeroDivisionError:
        if a == 0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)


_ARITHMETIC: dict[str, Callable[[float, float], float]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": _divide,
    "%": lambda a, b: _safe(math.fmod, a, b),
    "^": lambda a, b: _safe(math.pow, a, b),
    "atan2": math.atan2,
}
_COMPARISON: dict[str, Callable[[float, float], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
    ">=": operator.ge,
    "<=": operator.le,
}
_SET_OPERATORS = ("and", "or", "unless")


def _binary(node: pp.BinaryExpr, context: _Context) -> Value:
    op = str(node.op)
    modifier = node.modifier
    if modifier is not None and (modifier.fill_values.lhs is not None or modifier.fill_values.rhs is not None):
        raise UnsupportedPromQL("fill modifiers on binary operators")
    lhs, rhs = _eval(node.lhs, context), _eval(node.rhs, context)
    if op in _SET_OPERATORS:
        return _set_operation(op, _vector_arg(lhs, op), _vector_arg(rhs, op), modifier)
    if op not in _ARITHMETIC and op not in _COMPARISON:
        raise UnsupportedPromQL(f"binary operator {op}")
    return_bool = bool(modifier is not None and modifier.return_bool)
    if isinstance(lhs, float) and isinstance(rhs, float):
        return _scalar_op(op, lhs, rhs)
    if isinstance(lhs, float):
        return _vector_scalar(op, _vector_arg(rhs, op), lhs, vector_left=False, return_bool=return_bool)
    if isinstance(rhs, float):
        return _vector_scalar(op, _vector_arg(lhs, op), rhs, vector_left=True, return_bool=return_bool)
    return _vector_vector(op, _vector_arg(lhs, op), _vector_arg(rhs, op), modifier, return_bool)


def _scalar_op(op: str, a: float, b: float) -> float:
    if op in _COMPARISON:  # between scalars the parser insists on `bool`
        return float(_COMPARISON[op](a, b))
    return _ARITHMETIC[op](a, b)


def _vector_scalar(op: str, vector: _Vector, scalar: float, vector_left: bool, return_bool: bool) -> _Vector:
    """Apply to every element; a comparison without `bool` filters and keeps the vector's own value."""
    result = _Vector()
    for labels, value in vector.items():
        a, b = (value, scalar) if vector_left else (scalar, value)
        if op in _ARITHMETIC:
            result[_drop_name(labels)] = _ARITHMETIC[op](a, b)
        elif return_bool:
            result[_drop_name(labels)] = float(_COMPARISON[op](a, b))
        elif _COMPARISON[op](a, b):
            result[labels] = value
    return result


def _signature(modifier: pp.BinModifier | None) -> Callable[[Labels], Labels]:
    """The labels two series must share to match: all but the name, or as `on`/`ignoring` says."""
    matching = modifier.matching if modifier is not None else None
    if matching is None:
        return _drop_name
    names = set(matching.labels)
    if matching.type == pp.LabelModifierType.Include:
        return lambda labels: frozenset(pair for pair in labels if pair[0] in names)
    names.add(NAME)
    return lambda labels: frozenset(pair for pair in labels if pair[0] not in names)


def _vector_vector(op: str, lhs: _Vector, rhs: _Vector, modifier: pp.BinModifier | None,
                   return_bool: bool) -> _Vector:
    """One-to-one matching, or many-to-one with group_left / one-to-many with group_right.

    The "one" side is indexed by signature; each series of the "many" side finds its partner there.
    Duplicates where uniqueness is required are errors, as in Prometheus, instead of an arbitrary pick.
    """
    signature = _signature(modifier)
    card = modifier.card if modifier is not None else pp.VectorMatchCardinality.OneToOne
    many_is_left = card != pp.VectorMatchCardinality.OneToMany
    many, one = (lhs, rhs) if many_is_left else (rhs, lhs)
    partners = _index_unique(one, signature, "right" if many_is_left else "left")
    one_to_one = card == pp.VectorMatchCardinality.OneToOne
    matched: set[Labels] = set()
    result = _Vector()
    for labels, value in many.items():
        key = signature(labels)
        if key not in partners:
            continue
        if one_to_one and key in matched:
            raise PromQLError(f"many-to-one matching for {dict(key)} needs group_left or group_right")
        matched.add(key)
        other_labels, other_value = partners[key]
        a, b = (value, other_value) if many_is_left else (other_value, value)
        outcome = _element(op, a, b, return_bool)
        if outcome is None:
            continue
        drop_name = op in _ARITHMETIC or return_bool
        out_labels = _result_labels(labels, other_labels, modifier, one_to_one, drop_name)
        if out_labels in result:
            raise PromQLError(f"{op} gives two series with the same labels {dict(out_labels)}")
        result[out_labels] = outcome
    return result


def _index_unique(vector: _Vector, signature: Callable[[Labels], Labels],
                  side: str) -> dict[Labels, tuple[Labels, float]]:
    index: dict[Labels, tuple[Labels, float]] = {}
    for labels, value in vector.items():
        key = signature(labels)
        if key in index:
            raise PromQLError(f"several series on the {side} side match {dict(key)}; "
                              "aggregate them or narrow the matching with on()/ignoring()")
        index[key] = (labels, value)
    return index


def _element(op: str, a: float, b: float, return_bool: bool) -> float | None:
    """One matched pair's value; None when a filtering comparison drops it (it keeps the left value)."""
    if op in _ARITHMETIC:
        return _ARITHMETIC[op](a, b)
    holds = _COMPARISON[op](a, b)
    if return_bool:
        return float(holds)
    return a if holds else None


def _result_labels(labels: Labels, other: Labels, modifier: pp.BinModifier | None, one_to_one: bool,
                   drop_name: bool) -> Labels:
    """One-to-one keeps only the `on` labels (or drops the `ignoring` ones); grouping copies the
    labels listed in group_left(...)/group_right(...) from the "one" side."""
    result = dict(labels)
    if drop_name:
        result.pop(NAME, None)
    matching = modifier.matching if modifier is not None else None
    if one_to_one and matching is not None:
        names = set(matching.labels)
        include = matching.type == pp.LabelModifierType.Include
        result = {k: v for k, v in result.items() if (k in names) == include}
    elif not one_to_one and modifier is not None:
        other_dict = dict(other)
        for name in modifier.group_labels:
            if other_dict.get(name):
                result[name] = other_dict[name]
            else:
                result.pop(name, None)
    return freeze_labels(result)


def _set_operation(op: str, lhs: _Vector, rhs: _Vector, modifier: pp.BinModifier | None) -> _Vector:
    """and / or / unless compare label signatures only; the values and labels of each side pass through."""
    signature = _signature(modifier)
    right_keys = {signature(labels) for labels in rhs}
    if op == "and":
        return _Vector({labels: v for labels, v in lhs.items() if signature(labels) in right_keys})
    if op == "unless":
        return _Vector({labels: v for labels, v in lhs.items() if signature(labels) not in right_keys})
    left_keys = {signature(labels) for labels in lhs}
    result = _Vector(lhs)
    result.update({labels: v for labels, v in rhs.items() if signature(labels) not in left_keys})
    return result


def _subquery(node: pp.SubqueryExpr, context: _Context) -> Value:
    raise UnsupportedPromQL("subqueries ([range:step])")


_HANDLERS: dict[type, Callable[[pp.Expr, _Context], Value]] = {
    pp.NumberLiteral: _number,
    pp.StringLiteral: _string,
    pp.ParenExpr: _paren,
    pp.UnaryExpr: _unary,
    pp.VectorSelector: _instant_selector,
    pp.MatrixSelector: _range_selector,
    pp.Call: _call,
    pp.AggregateExpr: _aggregate,
    pp.BinaryExpr: _binary,
    pp.SubqueryExpr: _subquery,
}


# ---- Grafana variables ----------------------------------------------------------------------------------

_VARIABLE = re.compile(r"\$\{(\w+)(?::[\w-]+)?\}|\$(\w+)")
_ALL = ("All", "$__all")


def interpolate(expr: str, variables: Mapping[str, str | Sequence[str]] | None = None,
                rate_interval: str = "1m", interval: str | None = None, range_: str | None = None) -> str:
    """Replace Grafana's variables in a panel query, as Grafana does before sending it to Prometheus.

    `$__rate_interval`, `$__interval` and `$__range` (plus `_ms`/`_s` forms) come from the arguments
    (`interval` and `range_` default to `rate_interval`); `$name`, `${name}` and `${name:format}` from
    `variables`. "All" (or `$__all`) becomes `.*`, and a list of values the regex `(a|b)`, which is how
    the dashboards' `=~"$model"` matchers expect multi-value variables. `$1`-style references (in
    label_replace) are left alone; any other unknown variable raises PromQLError, since a query with a
    literal `$model` in it would only fail later with a less helpful message.
    """
    values = _builtin_variables(rate_interval, interval or rate_interval, range_ or rate_interval)
    values.update({name: _variable_value(value) for name, value in (variables or {}).items()})

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in values:
            return values[name]
        if name.isdigit():
            return match.group(0)
        raise PromQLError(f"dashboard variable ${name} has no value (query {expr!r})")

    return _VARIABLE.sub(replace, expr)


def _variable_value(value: str | Sequence[str]) -> str:
    if isinstance(value, str):
        return ".*" if value in _ALL else value
    values = list(value)
    if not values or any(v in _ALL for v in values):
        return ".*"
    return values[0] if len(values) == 1 else "(" + "|".join(values) + ")"


def _builtin_variables(rate_interval: str, interval: str, range_: str) -> dict[str, str]:
    interval_s = _duration_s(interval)
    range_s = _duration_s(range_)
    return {
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__interval_ms": str(round(interval_s * 1000)),
        "__range": range_,
        "__range_s": str(round(range_s)),
        "__range_ms": str(round(range_s * 1000)),
    }


def _duration_s(duration: str) -> float:
    try:
        return pp.parse_duration(duration).total_seconds()
    except ValueError as exc:
        raise PromQLError(f"invalid duration {duration!r}: {exc}") from exc


def format_duration(seconds: float) -> str:
    """A PromQL duration for `seconds`, in whole milliseconds when it is not whole seconds."""
    millis = max(1, round(seconds * 1000))
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"
