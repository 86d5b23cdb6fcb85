"""The usage endpoints' query parameters, checked: /admin/usage's (`parse_usage_query`) and those of OpenAI's
Usage API, GET /v1/organization/usage/completions (`parse_completions_usage`), with the pages of buckets the
latter answers in. A bad parameter is a 400 in the API's error shape (shunter.errors.ApiError), never a 500:
both endpoints share how a time is read (`instant`) and the window check (`check_window`).

The Usage API's parameters are OpenAI's: `start_time` (unix seconds, inclusive, required), `end_time`
(exclusive; none: up to now, the last bucket the one now is in), `bucket_width` (1m, 1h, 1d; default 1d),
`limit` (buckets per page: 60, 24, 7 by default, at most 1440, 168, 31), `page` (the previous answer's
`next_page`), `group_by`, `models` and `api_key_ids` (arrays). OpenAI's own client sends an array as
`group_by[]=model&group_by[]=api_key_id`, others repeat `group_by=`; both are read, and so is a comma list.
Shunter groups by `model` and `api_key_id`; OpenAI's other fields (projects, users, batch, service tier, API
source) name nothing here, so grouping or filtering by them is a 400 that says what is supported, rather than
an answer that silently ignores it.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from shunter.config import ShunterConfig
from shunter.errors import ApiError
from shunter.usage_ledger import GROUP_COLUMNS

# bucket_width: (seconds, default limit, most buckets in a page), as OpenAI documents them.
WIDTHS = {"1m": (60, 60, 1440), "1h": (3600, 24, 168), "1d": (86400, 7, 31)}
GROUPS = {"model": "model", "api_key_id": "key_id"}  # the Usage API's group_by -> the store's (BUCKET_GROUPS)
OPENAI_ONLY = ("project_id", "user_id", "batch", "service_tier", "api_source")  # OpenAI's, nothing here
UNSUPPORTED_FILTERS = ("project_ids", "user_ids", "batch")
LATEST_S = 10**10  # no time past the year 2286 (a larger one is a mistake, and a bucket count to refuse)
_WHOLE = re.compile(r"[0-9]{1,12}")
_CURSOR = "page_"


class QueryParams(Protocol):
    """What is read of the request's query string (Starlette's QueryParams)."""

    def get(self, key: str, default: Any = None) -> Any: ...

    def getlist(self, key: str) -> list[str]: ...


# ---- shared by both endpoints ----------------------------------------------------------------------------

def instant(value: str | None, name: str) -> float | None:
    """Unix seconds, or an ISO 8601 date or time (UTC when it names no zone)."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
        except ValueError:
            raise ApiError(400, f"{name}: {value!r} is neither unix seconds nor an ISO 8601 time "
                           "(2026-01-31T12:00:00Z)", param=name, code="invalid_time") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = when.timestamp()
    if not math.isfinite(seconds) or seconds < 0:
        raise ApiError(400, f"{name}: {value!r} is not a time (unix seconds are finite and not negative)",
                       param=name, code="invalid_time")
    return seconds


def check_window(start: float | None, end: float | None, start_name: str, end_name: str) -> None:
    """400 when the window's end is before its start."""
    if start is not None and end is not None and end < start:
        raise ApiError(400, f"{end_name} ({end:g}) is before {start_name} ({start:g})", param=end_name,
                       code="invalid_window")


# ---- /admin/usage ----------------------------------------------------------------------------------------

def parse_usage_query(key: str | None, model: str | None, since: str | None, until: str | None,
                      group_by: str | None, config: ShunterConfig) -> dict[str, Any]:
    """/admin/usage's query parameters, checked: the model by any of its names (a name no longer served is
    taken as it is: its records stay in the ledger)."""
    found = config.find_model(model) if model is not None else None
    start, end = instant(since, "since"), instant(until, "until")
    check_window(start, end, "since", "until")
    groups = ["key", "model"] if group_by is None else [g.strip() for g in group_by.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUP_COLUMNS]
    if unknown:
        raise ApiError(400, f"group_by: {', '.join(map(repr, unknown))} not known; choose from "
                       f"{', '.join(GROUP_COLUMNS)}", param="group_by", code="invalid_group_by")
    return {"key": key, "model": found.name if found is not None else model, "since": start, "until": end,
            "group_by": tuple(dict.fromkeys(groups))}


# ---- the Usage API ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Page:
    """One page of buckets: each (start, end), and where the next page starts (None: this is the last)."""

    buckets: list[tuple[int, int]]
    next_start: int | None

    @property
    def since(self) -> int:
        return self.buckets[0][0]

    @property
    def until(self) -> int:
        return self.buckets[-1][1]

    @property
    def next_page(self) -> str | None:
        return None if self.next_start is None else cursor(self.next_start)


@dataclass(frozen=True)
class CompletionsUsageQuery:
    start: int
    end: int | None  # None: up to now
    width: int  # seconds
    limit: int  # buckets per page
    first: int  # this page's first bucket (start_time, or the cursor's)
    group_by: tuple[str, ...]  # the Usage API's names (GROUPS)
    models: tuple[str, ...] | None
    key_ids: tuple[str, ...] | None

    @property
    def store_groups(self) -> tuple[str, ...]:
        return tuple(GROUPS[g] for g in self.group_by)

    def page(self, now: float) -> Page:
        """This page's buckets: `limit` of them from `first`, each `width` wide and counted from start_time,
        every one listed (an empty one answers `results: []`, as OpenAI's does), the last cut at end_time; without
        end_time, up to the bucket now is in. No bucket when the window is empty or the cursor past it."""
        horizon = self.end if self.end is not None else now
        starts = [s for s in range(self.first, self.first + self.limit * self.width, self.width) if s < horizon]
        buckets = [(s, s + self.width if self.end is None else min(s + self.width, self.end)) for s in starts]
        after = self.first + self.limit * self.width
        return Page(buckets, after if after < horizon else None)


def parse_completions_usage(query: QueryParams, config: ShunterConfig) -> CompletionsUsageQuery:
    """GET /v1/organization/usage/completions's query parameters, checked (see the module docstring)."""
    raw_start = query.get("start_time")
    if raw_start is None or not str(raw_start).strip():
        raise ApiError(400, "start_time is required: the window's first second, in unix seconds",
                       param="start_time", code="missing_required_parameter")
    start = _whole(raw_start, "start_time", 0, LATEST_S)
    raw_end = query.get("end_time")
    end = _whole(raw_end, "end_time", 0, LATEST_S) if raw_end is not None and str(raw_end).strip() else None
    check_window(start, end, "start_time", "end_time")
    width_name = query.get("bucket_width") or "1d"
    if width_name not in WIDTHS:
        raise ApiError(400, f"bucket_width: {width_name!r} is not one of {', '.join(WIDTHS)}", param="bucket_width",
                       code="invalid_bucket_width")
    width, default_limit, most = WIDTHS[width_name]
    raw_limit = query.get("limit")
    limit = default_limit if raw_limit is None or not str(raw_limit).strip() else _whole(raw_limit, "limit", 1, most)
    for name in UNSUPPORTED_FILTERS:
        if _array(query, name):
            raise ApiError(400, f"{name}: this platform has no projects, users or batch-only usage to filter by; "
                           "filter by models and api_key_ids", param=name, code="unsupported_parameter")
    groups = _array(query, "group_by")
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        other = [g for g in unknown if g in OPENAI_ONLY]
        raise ApiError(400, f"group_by: {', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not "
                       f"supported{' on this platform' if other else ''}; group by {' and '.join(GROUPS)}",
                       param="group_by", code="invalid_group_by")
    models = _array(query, "models")
    key_ids = _array(query, "api_key_ids")
    page = query.get("page")
    first = start if page is None or not str(page).strip() else _page_start(str(page), start, width)
    return CompletionsUsageQuery(
        start=start, end=end, width=width, limit=limit, first=first, group_by=tuple(dict.fromkeys(groups)),
        models=tuple(dict.fromkeys(_served_name(m, config) for m in models)) if models else None,
        key_ids=tuple(dict.fromkeys(key_ids)) if key_ids else None)


def cursor(start: int) -> str:
    """A page's cursor: opaque to the client, the page's first bucket here (it opens nothing: every page is
    checked against the caller like the first)."""
    return _CURSOR + base64.urlsafe_b64encode(str(start).encode()).decode().rstrip("=")


def _page_start(value: str, start: int, width: int) -> int:
    refused = ApiError(400, "page: not a cursor this endpoint gave (pass the previous answer's next_page, with the "
                       "same start_time and bucket_width)", param="page", code="invalid_page")
    if not value.startswith(_CURSOR) or len(value) > 64:
        raise refused
    body = value[len(_CURSOR):]
    try:
        text = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode("ascii")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise refused from None
    if not _WHOLE.fullmatch(text):
        raise refused
    first = int(text)
    if first < start or (first - start) % width or first > LATEST_S:
        raise refused
    return first


def _whole(value: Any, name: str, lo: int, hi: int) -> int:
    text = str(value).strip()
    if not _WHOLE.fullmatch(text) or not lo <= int(text) <= hi:
        raise ApiError(400, f"{name}: {value!r} is not a whole number from {lo} to {hi}", param=name,
                       code="invalid_value")
    return int(text)


def _array(query: QueryParams, name: str) -> list[str]:
    """An array parameter as `name[]=a&name[]=b` (OpenAI's client), `name=a&name=b`, or `name=a,b`."""
    values = [*query.getlist(name), *query.getlist(f"{name}[]")]
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _served_name(name: str, config: ShunterConfig) -> str:
    """A model as the ledger's buckets name it: a configured model by any of its names, an adapter as
    `<model>:<adapter>`; another name (a model no longer served) as it is."""
    model = config.find_model(name)
    if model is not None:
        return model.name
    found = config.find_adapter(name)
    if found is not None:
        return f"{found[0].name}:{found[1].name}"
    return name
