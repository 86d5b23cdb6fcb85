"""The usage ledger's store: one row per settled request, in SQLite, and the sums /admin/usage and the Usage
API (GET /v1/organization/usage/completions) answer.

A `UsageRecord` is what one request used and what it cost: who (the key's configured name and public id),
what (model, LoRA adapter, priority class, endpoint), how it ended (its status) and the tokens its key was
charged (prompt, of which cached, and completion). `cost_of` prices them with the model's `pricing`.

`LedgerStore` keeps the records in one SQLite file (stdlib `sqlite3`: no server to run). The request id is
the primary key and every batch is written in one transaction that skips the ids already there, so a batch
sent again after its reply was lost is counted once, and a batch is either all in or not at all. A row may
stand for several requests (`requests`): a gateway counts its refusals (records that used nothing, see
`UsageRecord.refusal`) per minute and kind and sends the count so far under one id, whose larger count
replaces the smaller; a flood of 429s is a few rows a minute, not a row each. The id is the gateway's own per-request id (never a client's X-Request-ID, which a client may
repeat, and a repeat would hide a request from its bill). WAL journaling lets queries read while a batch is
written; a busy timeout lets two writers (two threads, or a store reopened beside another) wait for each
other instead of failing.

Bounded: rows older than `retention_days` are deleted when the store opens and then at most once an hour on a
write (the `at` index makes it cheap), and `max_size_mb` caps the file (SQLite's max_page_count). A write the
file cannot take (that cap, or a full disk) never raises: the batch is held in memory, summed per minute and
group (shunter.usage_held), the queries add what is held, a warning says so once (`degraded`), and a later
write that the file takes writes it back. The store is pure Python and knows nothing of Ray: the Serve
deployment around it (shunter.deployments.ledger) exports `degraded` and `held_total` as metrics.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from shunter.usage_held import MAX_HELD_ROWS, HeldUsage

log = logging.getLogger("ray.serve")

GROUP_COLUMNS = ("key", "model", "adapter", "priority_class", "endpoint")  # what /admin/usage groups by
_COLUMN_OF = {"key": "key_name", "model": "model", "adapter": "adapter", "priority_class": "priority_class",
              "endpoint": "endpoint"}
# What the Usage API groups by: the model as it was asked for (`<model>:<adapter>` for an adapter's
# requests, as a fine-tuned model has a name of its own at OpenAI) and the key's public id.
SERVED_MODEL = "CASE WHEN adapter = '' THEN model ELSE model || ':' || adapter END"
BUCKET_GROUPS = {"model": SERVED_MODEL, "key_id": "key_id"}
BUSY_TIMEOUT_MS = 10_000
PRUNE_EVERY_S = 3600.0  # retention runs at most this often on writes
RETRY_S = 10.0  # while degraded, how often a write tries the file again (the others go to memory at once)
_NO_PAGE_LIMIT = 2**31 - 2  # a stopping store writes what it holds past its own size bound


class Pricing(Protocol):
    """What `cost_of` reads (shunter.config.PricingConfig)."""

    input_per_million: float
    output_per_million: float

    @property
    def cached_price(self) -> float: ...


@dataclass(frozen=True)
class UsageRecord:
    """One settled request's usage, as its key was charged."""

    request_id: str  # unique per request: the gateway's own id for it, never the client's X-Request-ID
    at: float  # when it settled, unix seconds
    key_name: str  # the key's configured name ("anonymous" without keys)
    key_id: str  # the key's public id (shunter.auth.key_id), never the key
    model: str  # the configured model's name
    adapter: str  # the LoRA adapter's name, "" for the base model
    priority_class: str
    endpoint: str  # the endpoint's name (chat, completions, embeddings, responses, messages, ...)
    status: str  # what the client saw: 200, 429, 499, stream_error, ...
    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, those the engine had cached
    completion_tokens: int
    cost: float | None  # None: the model has no pricing
    # How many requests the row stands for: 1, or a refusal counter's count so far in its minute (a gateway
    # counts the refusals of a kind per minute instead of sending a row each; shunter.deployments.gateway.usage).
    requests: int = 1

    @property
    def refusal(self) -> bool:
        """It used nothing and did not succeed (a 429, a 499 in the queue, a 503 queue timeout): such records
        are counted per minute, and they are not model requests (REFUSAL_SQL is the same test in SQL)."""
        return not (self.prompt_tokens or self.cached_tokens or self.completion_tokens) and self.status != "200"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UsageRecord:
        """A record from `to_dict`'s form (what crosses Ray's wire); unknown keys are refused."""
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown usage record fields: {sorted(unknown)}")
        return cls(**data)


def cost_of(pricing: Pricing | None, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
            multiplier: float = 1.0) -> float | None:
    """What the tokens cost under `pricing` (None without one): the prompt tokens the engine had not cached at
    the input price, the cached ones at the cached price, the completion at the output price; all of it times
    the request's class's `multiplier`."""
    if pricing is None:
        return None
    cached = max(0, min(cached_tokens, prompt_tokens))
    return ((prompt_tokens - cached) * pricing.input_per_million + cached * pricing.cached_price
            + completion_tokens * pricing.output_per_million) * multiplier / 1e6


_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT PRIMARY KEY,
    at REAL NOT NULL,
    key_name TEXT NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    adapter TEXT NOT NULL,
    priority_class TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    status TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost REAL,
    requests INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS usage_at ON usage (at);
CREATE INDEX IF NOT EXISTS usage_key_at ON usage (key_name, at);
"""
_COLUMNS = [f.name for f in fields(UsageRecord)]
REFUSAL_SQL = "(prompt_tokens = 0 AND cached_tokens = 0 AND completion_tokens = 0 AND status != '200')"
# A request id already there changes nothing (a batch sent again), unless the row is a refusal counter and the
# new count is larger (a later send of the same minute); INSERT OR IGNORE would also skip a row that breaks
# NOT NULL, so the conflict is named.
_UPSERT = ("ON CONFLICT (request_id) DO UPDATE SET requests = excluded.requests "
           "WHERE excluded.requests > usage.requests")
_INSERT = f"INSERT INTO usage ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) {_UPSERT}"


class LedgerStore:
    """The ledger's SQLite file; see the module docstring. Safe to share between threads (one connection,
    used under a lock); several stores, in threads or processes, may open the same file.

    `retention_days`: rows older than that are deleted (None: kept); `max_size_mb`: the file's bound in MiB
    (None: the disk's size; SQLite cannot shrink a file below what it holds, so a smaller bound than the file
    is the file's size); `clock`: unix seconds."""

    def __init__(self, path: str | os.PathLike[str], retention_days: float | None = None,
                 max_size_mb: float | None = None, clock: Callable[[], float] = time.time,
                 max_held_rows: int = MAX_HELD_ROWS):
        self.path = Path(os.path.expanduser(os.fspath(path)))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.retention_days, self.max_size_mb, self._clock = retention_days, max_size_mb, clock
        self.degraded = False  # the file took no write lately: batches are held in memory
        self.held_total = 0  # records held in memory since the store opened
        self._tried_at = self._pruned_at = -PRUNE_EVERY_S
        self._lock = threading.Lock()
        # isolation_level=None: autocommit, and each write opens its own transaction explicitly.
        self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                   check_same_thread=False)
        with self._lock:
            self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._db.execute("PRAGMA journal_mode = WAL")
            # FULL: each batch's commit is on disk when write() returns (a power loss keeps it too); one
            # sync per batch, not per request.
            self._db.execute("PRAGMA synchronous = FULL")
            self._db.execute("PRAGMA temp_store = MEMORY")  # what is held while the disk is full stays off it
            self._db.executescript(_SCHEMA)
            if "requests" not in {row[1] for row in self._db.execute("PRAGMA table_info(usage)")}:
                # A file from before refusal counters: each of its rows is one request.
                self._db.execute("ALTER TABLE usage ADD COLUMN requests INTEGER NOT NULL DEFAULT 1")
            if max_size_mb is not None:
                page = int(self._db.execute("PRAGMA page_size").fetchone()[0])
                self._db.execute(f"PRAGMA max_page_count = {max(1, int(max_size_mb * 2**20) // page)}")
            self.held = HeldUsage(self._db, _COLUMNS, _UPSERT, uuid.uuid4().hex[:12], max_held_rows)
            self._prune(self._clock())

    # ---- writing ---------------------------------------------------------------------------------------

    def write(self, records: Iterable[UsageRecord]) -> int:
        """Add the records in one transaction; those whose request id is already there are skipped (a batch
        sent again), except that a refusal counter's larger count replaces its smaller one. Returns how many
        rows were new or changed. A batch the file cannot take (full) is held instead (see the module
        docstring); any other failure raises and writes nothing."""
        batch = list(records)
        if not batch:
            return 0
        with self._lock:
            now = self._clock()
            if now - self._pruned_at >= PRUNE_EVERY_S:
                self._prune(now)
            if self.degraded and now - self._tried_at < RETRY_S:
                return self._hold(batch, now)
            try:
                return self._write_file(batch)
            except sqlite3.OperationalError as exc:
                if not _full(exc):
                    raise
                self._tried_at = now
                if not self.degraded:
                    self.degraded = True
                    log.warning("usage ledger %s takes no writes (%s%s): holding usage in memory, summed per minute; "
                                "queries include it, and it is written to the file once the file takes writes "
                                "again (free disk space or raise usage.max_size_mb)", self.path, exc,
                                f"; the file is at usage.max_size_mb={self.max_size_mb:g}"
                                if self.max_size_mb is not None else "")
                return self._hold(batch, now)

    def _write_file(self, batch: list[UsageRecord]) -> int:
        holding = self.held.holding
        # A record summed in memory is written with its sum (now, or already), not again.
        summed = self.held.already_held([r.request_id for r in batch])
        batch = [r for r in batch if r.request_id not in summed]
        rows = [tuple(getattr(r, c) for c in _COLUMNS) for r in batch]
        self._db.execute("BEGIN IMMEDIATE")
        try:
            written = self.held.write_back() if holding else 0
            before = self._db.total_changes
            self._db.executemany(_INSERT, rows)
            changed = self._db.total_changes - before
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:  # SQLite may have rolled a full write back itself
                self._db.execute("ROLLBACK")
            raise
        if holding:
            self.held.clear()
        if self.degraded:
            self.degraded = False
            log.info("usage ledger %s takes writes again: %d row(s) of usage held in memory written", self.path,
                     written)
        return changed

    def _hold(self, batch: list[UsageRecord], now: float) -> int:
        taken = self.held.hold(batch, now)
        self.held_total += taken
        return taken

    def _prune(self, now: float) -> None:
        """Retention: delete what settled more than `retention_days` ago (held rows too)."""
        self._pruned_at = now
        if self.retention_days is None:
            return
        cutoff = now - self.retention_days * 86400
        try:
            self._db.execute("BEGIN IMMEDIATE")
            deleted = self._db.execute("DELETE FROM usage WHERE at < ?", (cutoff,)).rowcount
            self._db.execute("COMMIT")
        except sqlite3.OperationalError as exc:  # a full disk can refuse a delete too: the next hour tries again
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            log.warning("usage ledger %s: retention could not delete old rows (%s)", self.path, exc)
        else:
            if deleted:
                log.info("usage ledger %s: %d row(s) older than %g day(s) deleted", self.path, deleted,
                         self.retention_days)
        self.held.prune(cutoff)

    # ---- reading ---------------------------------------------------------------------------------------

    def query(self, key: str | None = None, model: str | None = None, since: float | None = None,
              until: float | None = None, group_by: Sequence[str] = ("key", "model")) -> list[dict[str, Any]]:
        """Sums over the records settled in [since, until) (either end open when None), of one key's name
        and one model when given, one row per distinct value of the `group_by` columns (GROUP_COLUMNS; none:
        one row for everything, or no row when nothing matched): requests (refusals included), prompt_tokens,
        cached_tokens, completion_tokens, cost (None when no record in the row was priced), first_at, last_at."""
        unknown = [g for g in group_by if g not in _COLUMN_OF]
        if unknown:
            raise ValueError(f"cannot group by {unknown}; choose from {list(GROUP_COLUMNS)}")
        groups = list(dict.fromkeys(group_by))
        where, args = _window(since, until)
        for column, value in (("key_name", key), ("model", model)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        columns = [_COLUMN_OF[g] for g in groups]
        selected = [f"{c} AS {g}" for c, g in zip(columns, groups, strict=True)]
        found = self._sums(selected, columns, where, args, ["MIN(at)", "MAX(at)"])
        rows = []
        for row in found:
            if not row[len(groups)]:  # no group: one row of nothing when nothing matched
                continue
            values = dict(zip(groups, row[:len(groups)], strict=True))
            requests, prompt, cached, completion, cost, first, last = row[len(groups):]
            rows.append({**values, "requests": requests, "prompt_tokens": prompt, "cached_tokens": cached,
                         "completion_tokens": completion, "cost": cost, "first_at": first, "last_at": last})
        return rows

    def buckets(self, since: float, until: float, width_s: int, group_by: Sequence[str] = (),
                key: str | None = None, key_ids: Sequence[str] | None = None,
                models: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The Usage API's sums: model requests (refusal counters left out: they reached no model) settled in
        [since, until), per bucket of `width_s` seconds counted from `since` (`bucket` n is [since + n * width_s,
        since + (n + 1) * width_s)) and per BUCKET_GROUPS column in `group_by`, of one key's name, some key ids
        and some models (SERVED_MODEL) when given; ordered by bucket, then group. Each row: bucket, its groups,
        requests, prompt_tokens, cached_tokens, completion_tokens, cost. A bucket with nothing has no row."""
        unknown = [g for g in group_by if g not in BUCKET_GROUPS]
        if unknown:
            raise ValueError(f"cannot group buckets by {unknown}; choose from {list(BUCKET_GROUPS)}")
        groups = list(dict.fromkeys(group_by))
        where, args = _window(since, until)
        where.append(f"NOT {REFUSAL_SQL}")
        if key is not None:
            where.append("key_name = ?")
            args.append(key)
        for expression, values in (("key_id", key_ids), (SERVED_MODEL, models)):
            if values is not None:
                where.append(f"{expression} IN ({', '.join('?' * len(values))})")
                args.extend(values)
        columns = [BUCKET_GROUPS[g] for g in groups]
        bucket = f"CAST((at - {float(since)!r}) / {int(width_s)} AS INTEGER)"
        # Aliased apart from the columns: GROUP BY `model` would name the column, not the served model.
        found = self._sums([f"{bucket} AS bucket", *(f"{c} AS by_{g}" for c, g in zip(columns, groups, strict=True))],
                           ["bucket", *(f"by_{g}" for g in groups)], where, args)
        names = ["bucket", *groups, "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost"]
        return [dict(zip(names, row, strict=True)) for row in found]

    def _sums(self, selected: list[str], grouped: list[str], where: list[str], args: list[Any],
              extra: Sequence[str] = ()) -> list[tuple[Any, ...]]:
        sums = ["SUM(requests)", "SUM(prompt_tokens)", "SUM(cached_tokens)", "SUM(completion_tokens)", "SUM(cost)",
                *extra]
        with self._lock:
            sql = (f"SELECT {', '.join([*selected, *sums])} FROM {self.held.source()}"
                   + (f" WHERE {' AND '.join(where)}" if where else "")
                   + (f" GROUP BY {', '.join(grouped)} ORDER BY {', '.join(grouped)}" if grouped else ""))
            return self._db.execute(sql, args).fetchall()

    def count(self) -> int:
        """Rows in the file (what is held in memory not included)."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM usage").fetchone()[0])

    def close(self) -> None:
        """Close the file; what is held in memory is written first, past `max_size_mb` if need be (a size bound
        is a policy, a bill is not: the held rows are a few per minute and group), and only a full disk loses
        it, with an error line."""
        with self._lock:
            if self.held.holding:
                try:
                    self._db.execute(f"PRAGMA max_page_count = {_NO_PAGE_LIMIT}")
                    self._write_file([])
                except sqlite3.OperationalError as exc:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    log.error("usage ledger %s: %d row(s) of usage held in memory are lost (%s)", self.path,
                              self.held.rows, exc)
            self._db.close()


def _window(since: float | None, until: float | None) -> tuple[list[str], list[Any]]:
    """The WHERE clauses and arguments of [since, until)."""
    where: list[str] = []
    args: list[Any] = []
    if since is not None:
        where.append("at >= ?")
        args.append(since)
    if until is not None:
        where.append("at < ?")
        args.append(until)
    return where, args


def _full(exc: sqlite3.OperationalError) -> bool:
    """A write refused for want of space: SQLITE_FULL (the disk, or max_page_count), or an I/O error (how a
    full disk can also show, a WAL frame or a sync that could not be written)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR)
    return "full" in str(exc) or "I/O error" in str(exc)
