"""The usage ledger's store: one row per settled request, in SQLite, and the sums /admin/usage answers.

A `UsageRecord` is what one request used and what it cost: who (the key's configured name and public id),
what (model, LoRA adapter, priority class, endpoint), how it ended (its status) and the tokens its key was
charged (prompt, of which cached, and completion). `cost_of` prices them with the model's `pricing`.

`LedgerStore` keeps the records in one SQLite file (stdlib `sqlite3`: no server to run). The request id is
the primary key and every batch is written in one transaction that skips the ids already there (ON CONFLICT
DO NOTHING), so a batch sent again after its reply was lost is counted once, and a batch is either all in or
not at all. The id is the gateway's own per-request id (never a client's X-Request-ID, which a client may
repeat, and a repeat would hide a request from its bill). WAL journaling lets queries read while a batch is
written; a busy timeout lets two writers (two threads, or a store reopened beside another) wait for each
other instead of failing. The store is pure Python and knows nothing of Ray:
the Serve deployment around it is shunter.deployments.ledger.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

GROUP_COLUMNS = ("key", "model", "adapter", "priority_class", "endpoint")  # what /admin/usage groups by
_COLUMN_OF = {"key": "key_name", "model": "model", "adapter": "adapter", "priority_class": "priority_class",
              "endpoint": "endpoint"}
BUSY_TIMEOUT_MS = 10_000


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
    cost REAL
);
CREATE INDEX IF NOT EXISTS usage_at ON usage (at);
CREATE INDEX IF NOT EXISTS usage_key_at ON usage (key_name, at);
"""
_COLUMNS = [f.name for f in fields(UsageRecord)]
# Only a request id already there is skipped (INSERT OR IGNORE would also skip a row that breaks NOT NULL).
_INSERT = (f"INSERT INTO usage ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
           "ON CONFLICT (request_id) DO NOTHING")


class LedgerStore:
    """The ledger's SQLite file; see the module docstring. Safe to share between threads (one connection,
    used under a lock); several stores, in threads or processes, may open the same file."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(os.path.expanduser(os.fspath(path)))
        self.path.parent.mkdir(parents=True, exist_ok=True)
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
            self._db.executescript(_SCHEMA)

    def write(self, records: Iterable[UsageRecord]) -> int:
        """Add the records in one transaction; those whose request id is already there are skipped (a batch
        sent again). Returns how many were new."""
        rows = [tuple(getattr(r, c) for c in _COLUMNS) for r in records]
        if not rows:
            return 0
        with self._lock:
            before = self._db.total_changes
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(_INSERT, rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return self._db.total_changes - before

    def query(self, key: str | None = None, model: str | None = None, since: float | None = None,
              until: float | None = None, group_by: Sequence[str] = ("key", "model")) -> list[dict[str, Any]]:
        """Sums over the records settled in [since, until) (either end open when None), of one key's name
        and one model when given, one row per distinct value of the `group_by` columns (GROUP_COLUMNS; none:
        one row for everything, or no row when nothing matched): requests, prompt_tokens, cached_tokens,
        completion_tokens, cost (None when no record in the row was priced), first_at, last_at."""
        unknown = [g for g in group_by if g not in _COLUMN_OF]
        if unknown:
            raise ValueError(f"cannot group by {unknown}; choose from {list(GROUP_COLUMNS)}")
        groups = list(dict.fromkeys(group_by))
        where, args = [], []
        for column, value in (("key_name", key), ("model", model)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if since is not None:
            where.append("at >= ?")
            args.append(since)
        if until is not None:
            where.append("at < ?")
            args.append(until)
        selected = [f"{_COLUMN_OF[g]} AS {g}" for g in groups]
        sql = (f"SELECT {', '.join([*selected, 'COUNT(*)', 'SUM(prompt_tokens)', 'SUM(cached_tokens)'])}, "
               "SUM(completion_tokens), SUM(cost), MIN(at), MAX(at) FROM usage"
               + (f" WHERE {' AND '.join(where)}" if where else "")
               + (f" GROUP BY {', '.join(_COLUMN_OF[g] for g in groups)}" if groups else "")
               + (f" ORDER BY {', '.join(_COLUMN_OF[g] for g in groups)}" if groups else ""))
        with self._lock:
            found = self._db.execute(sql, args).fetchall()
        rows = []
        for row in found:
            if not row[len(groups)]:  # no group: one row of nothing when nothing matched
                continue
            values = dict(zip(groups, row[:len(groups)], strict=True))
            requests, prompt, cached, completion, cost, first, last = row[len(groups):]
            rows.append({**values, "requests": requests, "prompt_tokens": prompt, "cached_tokens": cached,
                         "completion_tokens": completion, "cost": cost, "first_at": first, "last_at": last})
        return rows

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM usage").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
