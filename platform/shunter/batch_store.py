"""The Batch API's durable state: uploaded files, batches, and each batch's input lines with their outcome.

What OpenAI's Files and Batch APIs (`/v1/files`, `/v1/batches`) need kept across a gateway's or a replica's
death and a redeploy: who owns each file and batch (a key's public id, never the key), a batch's status and
timestamps, and per input line whether it is still to run, what it answered, or why it failed. A line's
outcome is written once: `finish_line` changes only a line not yet finished, so a line run twice (its
runner died after the engine answered and before the write, then ran again) keeps one outcome and is
counted once in `request_counts`.

One code path over two databases through SQLAlchemy Core: SQLite in a file on the head node by default
(no server to run; WAL journaling so reads go on while a line is written), or PostgreSQL at a `postgresql://`
URL for clusters that keep state outside the head node. The store is pure Python and knows nothing of Ray or
HTTP; file contents live beside it (shunter.batch_files).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

# OpenAI's batch statuses, in the order a batch goes through them (a batch ends in one of the last four).
STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")
ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
# The timestamp each status sets when a batch enters it (the batch object's `<status>_at` fields).
STATUS_TIMES = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
                "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
                "cancelled": "cancelled_at"}
LINE_STATES = ("pending", "done", "error")  # error: answered with an error, or never valid

_meta = sa.MetaData()

FILES = sa.Table(
    "files", _meta,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("owner", sa.String(128), nullable=False, index=True),  # the key's public id; "" without keys
    sa.Column("filename", sa.String(512), nullable=False),
    sa.Column("purpose", sa.String(32), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.BigInteger, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False, index=True),  # the listing order: nanoseconds, rising
    sa.Column("deleted", sa.Boolean, nullable=False, default=False),
)

BATCHES = sa.Table(
    "batches", _meta,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("owner", sa.String(128), nullable=False, index=True),
    sa.Column("input_file_id", sa.String(64), nullable=False),
    sa.Column("endpoint", sa.String(64), nullable=False),
    sa.Column("completion_window", sa.String(16), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", sa.BigInteger, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False, index=True),
    sa.Column("expires_at", sa.BigInteger, nullable=False),
    *(sa.Column(name, sa.BigInteger, nullable=True) for name in STATUS_TIMES.values()),
    sa.Column("output_file_id", sa.String(64), nullable=True),
    sa.Column("error_file_id", sa.String(64), nullable=True),
    sa.Column("errors", sa.JSON, nullable=True),  # the batch's own errors (why it failed), OpenAI's shape
    sa.Column("metadata", sa.JSON, nullable=True),
)

LINES = sa.Table(
    "batch_lines", _meta,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("line", sa.Integer, primary_key=True),  # 1-based, as OpenAI's error lines count them
    sa.Column("custom_id", sa.String(512), nullable=False),
    sa.Column("request", sa.JSON, nullable=True),  # the body to send; None for a line that was never valid
    sa.Column("state", sa.String(8), nullable=False),
    sa.Column("result", sa.JSON, nullable=True),  # the output or error line, as written to the result files
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("finished_at", sa.BigInteger, nullable=True),
    sa.Index("batch_lines_state", "batch_id", "state"),
)


def new_id(prefix: str) -> str:
    """An id in OpenAI's style (`file-...`, `batch_...`): 24 random hex digits after the prefix."""
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass(frozen=True)
class StoredFile:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None, "expires_at": None}


@dataclass
class Batch:
    id: str
    owner: str
    input_file_id: str
    endpoint: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    times: dict[str, int | None] = field(default_factory=dict)  # STATUS_TIMES' fields
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"total": 0, "completed": 0, "failed": 0})

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "expires_at": self.expires_at,
            **{name: self.times.get(name) for name in STATUS_TIMES.values()},
            "request_counts": dict(self.counts), "metadata": self.metadata or {},
        }


@dataclass(frozen=True)
class PendingLine:
    batch_id: str
    line: int
    custom_id: str
    request: dict[str, Any]
    attempts: int


def engine_url(url_or_path: str) -> str:
    """A SQLAlchemy URL: `postgresql://...` as given (driven by psycopg), anything else a SQLite file path
    (`~` expanded, its folder made)."""
    if "://" in url_or_path:
        if url_or_path.startswith("postgresql://"):
            return "postgresql+psycopg://" + url_or_path.removeprefix("postgresql://")
        return url_or_path
    path = Path(url_or_path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


class JobStore:
    def __init__(self, url_or_path: str, clock=time.time):
        """`url_or_path`: a SQLite file (made on first use) or a PostgreSQL URL. Tables are made if missing."""
        url = engine_url(url_or_path)
        self.sqlite = url.startswith("sqlite")
        self.engine = sa.create_engine(url, future=True, pool_pre_ping=not self.sqlite,
                                       connect_args={"timeout": 30} if self.sqlite else {})
        if self.sqlite:
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        self.clock = clock
        self._lock = threading.Lock()  # SQLite takes one writer at a time; so do we, within a process
        self._last_seq = 0
        _meta.create_all(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def _now(self) -> int:
        return int(self.clock())

    def _seq(self) -> int:
        """A rising number for listing order (`created_at` is whole seconds: uploads within one second would
        tie): the clock in nanoseconds, past the last one this store gave. Taken under the write lock."""
        self._last_seq = max(self._last_seq + 1, int(self.clock() * 1e9))
        return self._last_seq

    # ---- files ------------------------------------------------------------------------------------------

    def add_file(self, owner: str, filename: str, purpose: str, size: int, file_id: str | None = None) -> StoredFile:
        row = StoredFile(file_id or new_id("file-"), owner, filename, purpose, size, self._now())
        with self._lock, self.engine.begin() as db:
            db.execute(FILES.insert().values(id=row.id, owner=owner, filename=filename, purpose=purpose,
                                             bytes=size, created_at=row.created_at, seq=self._seq(), deleted=False))
        return row

    def get_file(self, file_id: str, owner: str | None) -> StoredFile | None:
        """The file, if it exists, is not deleted and `owner` may see it (None: an admin sees every file)."""
        query = FILES.select().where(FILES.c.id == file_id, FILES.c.deleted.is_(False))
        if owner is not None:
            query = query.where(FILES.c.owner == owner)
        with self.engine.connect() as db:
            row = db.execute(query).mappings().first()
        return _file(row) if row else None

    def list_files(self, owner: str | None, purpose: str | None = None, after: str | None = None,
                   limit: int = 10000, newest_first: bool = True) -> tuple[list[StoredFile], bool]:
        """Files `owner` may see, newest first by default, from after the file `after`; and whether there
        are more past `limit`."""
        query = FILES.select().where(FILES.c.deleted.is_(False))
        if owner is not None:
            query = query.where(FILES.c.owner == owner)
        if purpose is not None:
            query = query.where(FILES.c.purpose == purpose)
        with self.engine.connect() as db:
            if after is not None:
                cursor = db.execute(sa.select(FILES.c.seq).where(FILES.c.id == after)).scalar()
                if cursor is not None:
                    query = query.where(FILES.c.seq < cursor if newest_first else FILES.c.seq > cursor)
            order = FILES.c.seq.desc() if newest_first else FILES.c.seq.asc()
            rows = db.execute(query.order_by(order).limit(limit + 1)).mappings().all()
        return [_file(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, owner: str | None) -> bool:
        """Marks the file deleted (its content is the caller's to remove); False if `owner` has no such file."""
        query = FILES.update().where(FILES.c.id == file_id, FILES.c.deleted.is_(False))
        if owner is not None:
            query = query.where(FILES.c.owner == owner)
        with self._lock, self.engine.begin() as db:
            return db.execute(query.values(deleted=True)).rowcount == 1

    # ---- batches ------------------------------------------------------------------------------------------

    def create_batch(self, owner: str, input_file_id: str, endpoint: str, completion_window: str,
                     window_s: int, metadata: dict[str, str] | None = None) -> Batch:
        now = self._now()
        batch = Batch(new_id("batch_"), owner, input_file_id, endpoint, completion_window, "validating", now,
                      now + window_s, metadata=metadata)
        with self._lock, self.engine.begin() as db:
            db.execute(BATCHES.insert().values(
                id=batch.id, owner=owner, input_file_id=input_file_id, endpoint=endpoint,
                completion_window=completion_window, status="validating", created_at=now, seq=self._seq(),
                expires_at=batch.expires_at, metadata=metadata))
        return batch

    def add_lines(self, batch_id: str, lines: Iterable[tuple[int, str, dict[str, Any] | None, dict[str, Any] | None]]) -> None:
        """A batch's input lines: (line number, custom_id, the request to send, or None with the error line
        of a line that was never valid). In one transaction: a batch is validated whole or not at all."""
        rows = []
        now = self._now()
        for line, custom_id, request, error in lines:
            rows.append({"batch_id": batch_id, "line": line, "custom_id": custom_id, "request": request,
                         "state": "pending" if error is None else "error", "result": error,
                         "attempts": 0, "finished_at": None if error is None else now})
        with self._lock, self.engine.begin() as db:
            for start in range(0, len(rows), 1000):
                db.execute(LINES.insert(), rows[start:start + 1000])

    def get_batch(self, batch_id: str, owner: str | None) -> Batch | None:
        query = BATCHES.select().where(BATCHES.c.id == batch_id)
        if owner is not None:
            query = query.where(BATCHES.c.owner == owner)
        with self.engine.connect() as db:
            row = db.execute(query).mappings().first()
            if row is None:
                return None
            return self._batch(db, row)

    def list_batches(self, owner: str | None, after: str | None = None, limit: int = 20,
                     statuses: Sequence[str] | None = None) -> tuple[list[Batch], bool]:
        """Batches `owner` may see, newest first, from after the batch `after` (OpenAI's list order)."""
        query = BATCHES.select()
        if owner is not None:
            query = query.where(BATCHES.c.owner == owner)
        if statuses is not None:
            query = query.where(BATCHES.c.status.in_(list(statuses)))
        with self.engine.connect() as db:
            if after is not None:
                cursor = db.execute(sa.select(BATCHES.c.seq).where(BATCHES.c.id == after)).scalar()
                if cursor is not None:
                    query = query.where(BATCHES.c.seq < cursor)
            rows = db.execute(query.order_by(BATCHES.c.seq.desc()).limit(limit + 1)).mappings().all()
            return [self._batch(db, r) for r in rows[:limit]], len(rows) > limit

    def active_batches(self) -> list[Batch]:
        """Every owner's batches not yet ended, oldest first: what a runner (re)starting has to carry on."""
        query = BATCHES.select().where(BATCHES.c.status.not_in(list(ENDED))).order_by(BATCHES.c.seq)
        with self.engine.connect() as db:
            return [self._batch(db, row) for row in db.execute(query).mappings().all()]

    def set_status(self, batch_id: str, status: str, only_from: Sequence[str] | None = None, **values: Any) -> bool:
        """Moves the batch to `status` (stamping its `<status>_at`), only from one of `only_from` when given;
        `values`: other columns (output_file_id, error_file_id, errors). False if it was in another status."""
        if status not in STATUSES:
            raise ValueError(f"unknown batch status {status!r}")
        query = BATCHES.update().where(BATCHES.c.id == batch_id)
        if only_from is not None:
            query = query.where(BATCHES.c.status.in_(list(only_from)))
        stamp = {STATUS_TIMES[status]: self._now()} if status in STATUS_TIMES else {}
        with self._lock, self.engine.begin() as db:
            return db.execute(query.values(status=status, **stamp, **values)).rowcount == 1

    # ---- lines ----------------------------------------------------------------------------------------

    def pending_lines(self, batch_id: str, limit: int, skip: Iterable[int] = ()) -> list[PendingLine]:
        """Up to `limit` of the batch's lines still to run, in input order, but those in `skip` (running)."""
        skipped = set(skip)
        query = (sa.select(LINES.c.line, LINES.c.custom_id, LINES.c.request, LINES.c.attempts)
                 .where(LINES.c.batch_id == batch_id, LINES.c.state == "pending")
                 .order_by(LINES.c.line).limit(limit + len(skipped)))
        with self.engine.connect() as db:
            rows = db.execute(query).all()
        return [PendingLine(batch_id, line, custom_id, request, attempts)
                for line, custom_id, request, attempts in rows if line not in skipped][:limit]

    def started_line(self, batch_id: str, line: int) -> None:
        """One more attempt at the line (a line found with attempts but still pending was cut short)."""
        with self._lock, self.engine.begin() as db:
            db.execute(LINES.update().where(LINES.c.batch_id == batch_id, LINES.c.line == line)
                       .values(attempts=LINES.c.attempts + 1))

    def finish_line(self, batch_id: str, line: int, result: dict[str, Any], ok: bool) -> bool:
        """The line's outcome (its output line when `ok`, else its error line), written once: False when
        the line had already finished (its first outcome stands)."""
        with self._lock, self.engine.begin() as db:
            return db.execute(
                LINES.update().where(LINES.c.batch_id == batch_id, LINES.c.line == line, LINES.c.state == "pending")
                .values(state="done" if ok else "error", result=result, finished_at=self._now())).rowcount == 1

    def has_lines(self, batch_id: str) -> bool:
        """Whether the batch's lines were stored (its validation finished)."""
        with self.engine.connect() as db:
            return db.execute(sa.select(LINES.c.line).where(LINES.c.batch_id == batch_id).limit(1)).first() is not None

    def finish_pending(self, batch_id: str, result: Callable[[int, str], dict[str, Any]]) -> int:
        """Every line still pending ends as an error line, `result(line, custom_id)` (a batch cancelled or
        expired); how many did."""
        with self._lock, self.engine.begin() as db:
            pending = db.execute(sa.select(LINES.c.line, LINES.c.custom_id).where(
                LINES.c.batch_id == batch_id, LINES.c.state == "pending")).all()
            now = self._now()
            for line, custom_id in pending:
                db.execute(LINES.update().where(LINES.c.batch_id == batch_id, LINES.c.line == line,
                                                LINES.c.state == "pending")
                           .values(state="error", result=result(line, custom_id), finished_at=now))
        return len(pending)

    def results(self, batch_id: str, ok: bool) -> Iterable[dict[str, Any]]:
        """The batch's output lines (`ok`) or error lines, in input order."""
        query = (sa.select(LINES.c.result).where(LINES.c.batch_id == batch_id,
                                                 LINES.c.state == ("done" if ok else "error"))
                 .order_by(LINES.c.line))
        with self.engine.connect() as db:
            return [row[0] for row in db.execute(query)]

    def counts(self, batch_id: str) -> dict[str, int]:
        with self.engine.connect() as db:
            return _counts(db, batch_id)

    def _batch(self, db: sa.Connection, row: Any) -> Batch:
        return Batch(row["id"], row["owner"], row["input_file_id"], row["endpoint"], row["completion_window"],
                     row["status"], row["created_at"], row["expires_at"],
                     {name: row[name] for name in STATUS_TIMES.values()}, row["output_file_id"],
                     row["error_file_id"], row["errors"], row["metadata"], _counts(db, row["id"]))


def _counts(db: sa.Connection, batch_id: str) -> dict[str, int]:
    """OpenAI's request_counts: every line, those answered, those failed (an error answer or never valid)."""
    by_state = dict(db.execute(sa.select(LINES.c.state, sa.func.count()).where(LINES.c.batch_id == batch_id)
                               .group_by(LINES.c.state)).all())
    return {"total": sum(by_state.values()), "completed": by_state.get("done", 0), "failed": by_state.get("error", 0)}


def _file(row: Any) -> StoredFile:
    return StoredFile(row["id"], row["owner"], row["filename"], row["purpose"], row["bytes"], row["created_at"])


def _sqlite_pragmas(connection: Any, _record: Any) -> None:
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()
