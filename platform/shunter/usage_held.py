"""What the usage ledger holds in memory while its file takes no writes (the disk full, or the file at
`usage.max_size_mb`), so that a full disk costs the ledger its durability for a while, never a gateway its
requests and never a bill its counts.

The gateways keep a batch the ledger did not take and send it again (shunter.deployments.gateway.usage); a
ledger that raised on a full disk would have every gateway resend forever while its buffer filled and, past
`usage.max_buffered_records`, dropped records. So the store (shunter.usage_ledger.LedgerStore) takes the batch
here instead and says it did. What is held lives in SQLite's temp schema of the store's own connection, in
memory (`PRAGMA temp_store = MEMORY`), so queries read the file and the held usage with the same SQL
(`source`), and writing it back when the file takes writes again is two INSERT ... SELECT in the batch's
transaction:

- `held`: sums per minute and group (key name and id, model, adapter, class, endpoint, status), however many
  records arrive; each row has an id of its own (`held:<store>:<n>`) and becomes one aggregate row of the file,
  its `requests` the count.
- `held_counts`: refusal counters (UsageRecord.refusal), by their request id, at the largest count seen, the
  file's own row of that id included (and the query then reads this row instead of the file's): a gateway
  sends a counter again with its absolute count, which a sum would count twice.
- `held_ids`: the ids summed into `held` (the latest MAX_HELD_IDS), so a batch sent again after a lost reply is
  not summed twice, nor written again once its sum is in the file (kept after the write-back for that); an id
  already in the file is skipped too.

Bounded: past `max_rows` rows in `held` and `held_counts`, counters older than COUNTER_FOLD_S (their gateways
have retired them: a minute is over and sent) fold into the sums, and past minutes merge into hours, then
days. The totals stay exact; only the time of old held usage gets coarser (a merged row is stamped with its
first record's time, so a per-minute query shows an hour's held usage in that minute).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from itertools import count
from typing import Any

MAX_HELD_ROWS = 100_000  # held + held_counts rows before old ones coarsen
MAX_HELD_IDS = 200_000  # ids remembered against a batch sent twice
COUNTER_FOLD_S = 600.0  # a refusal counter this old is no longer sent again by its gateway

_GROUP = ("key_name", "key_id", "model", "adapter", "priority_class", "endpoint", "status")
_SUMMED = ("prompt_tokens", "cached_tokens", "completion_tokens", "requests")
# SUM's rule for cost: NULL only when neither side was priced.
_ADD_COST = ("cost = CASE WHEN held.cost IS NULL THEN excluded.cost WHEN excluded.cost IS NULL THEN held.cost "
             "ELSE held.cost + excluded.cost END")
_ADD = (f"ON CONFLICT (slot, {', '.join(_GROUP)}) DO UPDATE SET at = MIN(held.at, excluded.at), "
        + ", ".join(f"{c} = held.{c} + excluded.{c}" for c in _SUMMED) + f", {_ADD_COST}")


class HeldUsage:
    """The held usage of one store's connection; see the module docstring. Called under the store's lock.
    `columns`: the file's columns in UsageRecord's order; `upsert`: the file's ON CONFLICT clause."""

    def __init__(self, db: sqlite3.Connection, columns: Sequence[str], upsert: str, name: str,
                 max_rows: int = MAX_HELD_ROWS):
        self._db, self._columns, self._upsert, self._max_rows = db, list(columns), upsert, max_rows
        assert self._columns[0] == "request_id", self._columns  # a held sum's row takes an id of its own
        self._ids = (f"held:{name}:{n}" for n in count())
        self.holding = False  # anything held (the queries then read the union)
        self._summed = False  # any id in held_ids
        cols = ", ".join(f"{c} {_TYPES.get(c, 'TEXT NOT NULL')}" for c in self._columns)
        db.executescript(f"""
            CREATE TEMP TABLE IF NOT EXISTS held ({cols}, slot INTEGER NOT NULL, UNIQUE (slot, {', '.join(_GROUP)}));
            CREATE TEMP TABLE IF NOT EXISTS held_counts ({cols}, PRIMARY KEY (request_id));
            CREATE TEMP TABLE IF NOT EXISTS held_ids (request_id TEXT PRIMARY KEY);
        """)

    @property
    def rows(self) -> int:
        """Rows held (sums and counters): what bounds the memory."""
        return sum(int(self._db.execute(f"SELECT COUNT(*) FROM temp.{t}").fetchone()[0]) for t in ("held", "held_counts"))

    def source(self) -> str:
        """What the queries read as `usage`: the file, and while anything is held, the held rows beside it."""
        if not self.holding:
            return "usage"
        cols = ", ".join(self._columns)
        return (f"(SELECT {cols} FROM main.usage WHERE request_id NOT IN (SELECT request_id FROM temp.held_counts) "
                f"UNION ALL SELECT {cols} FROM temp.held_counts UNION ALL SELECT {cols} FROM temp.held) AS usage")

    def hold(self, records: Sequence[Any], now: float) -> int:
        """Take a batch the file refused; returns how many of its records were new here (a record already in the
        file or held, or a counter at no larger count, adds nothing)."""
        sums = {r.request_id: r for r in records if not r.refusal}
        known = self._known(list(sums))
        fresh = [r for i, r in sums.items() if i not in known]
        counters = self._larger_counts([r for r in records if r.refusal])
        cols = ", ".join(self._columns)
        marks = ", ".join("?" * len(self._columns))
        self._db.execute("BEGIN")
        try:
            self._db.executemany(
                f"INSERT INTO temp.held ({cols}, slot) VALUES ({marks}, ?) {_ADD}",
                [(next(self._ids), *(getattr(r, c) for c in self._columns[1:]), int(r.at // 60) * 60) for r in fresh])
            self._db.executemany("INSERT OR IGNORE INTO temp.held_ids VALUES (?)", [(r.request_id,) for r in fresh])
            self._db.execute("DELETE FROM temp.held_ids WHERE rowid <= (SELECT MAX(rowid) FROM temp.held_ids) - ?",
                             (MAX_HELD_IDS,))
            self._db.executemany(
                f"INSERT INTO temp.held_counts ({cols}) VALUES ({marks}) ON CONFLICT (request_id) DO UPDATE SET "
                "requests = MAX(held_counts.requests, excluded.requests)", counters)
            self._summed = self._summed or bool(fresh)
            if fresh or counters:
                self.holding = True
                if self.rows > self._max_rows:
                    self._coarsen(now)
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        return len(fresh) + len(counters)

    def already_held(self, ids: Sequence[str]) -> set[str]:
        """Which of these ids were summed in `held`, held still or written back (a batch sent again: its records
        are already counted)."""
        return self._select("SELECT request_id FROM temp.held_ids WHERE request_id IN ({})", ids) if self._summed \
            else set()

    def write_back(self) -> int:
        """Into the file, in the caller's transaction: each held sum as one row, each counter at its count.
        Returns the rows written."""
        before = self._db.total_changes
        cols = ", ".join(self._columns)
        for table in ("held", "held_counts"):
            # `WHERE true`: an INSERT ... SELECT needs one before ON CONFLICT (SQLite's parsing ambiguity).
            self._db.execute(f"INSERT INTO usage ({cols}) SELECT {cols} FROM temp.{table} WHERE true {self._upsert}")
        return self._db.total_changes - before

    def clear(self) -> None:
        """What is held is in the file now; the ids summed are kept, against a late resend."""
        for table in ("held", "held_counts"):
            self._db.execute(f"DELETE FROM temp.{table}")
        self.holding = False

    def prune(self, cutoff: float) -> None:
        """Retention over the held rows too."""
        if self.holding:
            for table in ("held", "held_counts"):
                self._db.execute(f"DELETE FROM temp.{table} WHERE at < ?", (cutoff,))

    # ---- inside -----------------------------------------------------------------------------------------

    def _select(self, sql: str, ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for start in range(0, len(ids), 900):  # well within SQLite's bound on parameters
            chunk = ids[start:start + 900]
            found.update(row[0] for row in self._db.execute(sql.format(", ".join("?" * len(chunk))), chunk))
        return found

    def _known(self, ids: list[str]) -> set[str]:
        return self._select("SELECT request_id FROM main.usage WHERE request_id IN ({})", ids) | self.already_held(ids)

    def _larger_counts(self, counters: Sequence[Any]) -> list[tuple[Any, ...]]:
        """The counters' rows, each at the larger of its count and the file's row of its id (which the
        queries then skip), those that add nothing left out."""
        rows = []
        for r in counters:
            found = self._db.execute(
                "SELECT MAX(IFNULL((SELECT requests FROM main.usage WHERE request_id = ?), 0), "
                "IFNULL((SELECT requests FROM temp.held_counts WHERE request_id = ?), 0))",
                (r.request_id, r.request_id)).fetchone()[0]
            if r.requests > found:
                rows.append(tuple(getattr(r, c) for c in self._columns))
        return rows

    def _coarsen(self, now: float) -> None:
        group = ", ".join(_GROUP)
        cols = ", ".join(self._columns)
        summed = ", ".join(f"SUM({c}) AS {c}" for c in ("prompt_tokens", "cached_tokens", "completion_tokens", "cost",
                                                         "requests"))
        # Old counters into the sums, less what the file's row of each id already counts.
        self._db.execute(
            f"INSERT INTO temp.held ({cols}, slot) SELECT 'held:' || h.request_id, h.at, "
            f"{', '.join('h.' + c for c in _GROUP)}, 0, 0, 0, h.cost, h.requests - IFNULL(u.requests, 0), "
            "CAST(h.at / 60 AS INTEGER) * 60 FROM temp.held_counts AS h LEFT JOIN main.usage AS u "
            f"ON u.request_id = h.request_id WHERE h.at < ? AND h.requests > IFNULL(u.requests, 0) {_ADD}",
            (now - COUNTER_FOLD_S,))
        self._db.execute("DELETE FROM temp.held_counts WHERE at < ?", (now - COUNTER_FOLD_S,))
        for width in (3600, 86400):
            if self.rows <= self._max_rows // 2:
                return
            self._db.execute("DROP TABLE IF EXISTS temp.merged")
            self._db.execute(
                f"CREATE TEMP TABLE merged AS SELECT MIN(request_id) AS request_id, MIN(at) AS at, {group}, {summed}, "
                f"(slot / {width}) * {width} AS slot FROM temp.held GROUP BY slot / {width}, {group}")
            self._db.execute("DELETE FROM temp.held")
            self._db.execute(f"INSERT INTO temp.held ({cols}, slot) SELECT {cols}, slot FROM temp.merged")
            self._db.execute("DROP TABLE temp.merged")


_TYPES = {"at": "REAL NOT NULL", "prompt_tokens": "INTEGER NOT NULL", "cached_tokens": "INTEGER NOT NULL",
          "completion_tokens": "INTEGER NOT NULL", "cost": "REAL", "requests": "INTEGER NOT NULL"}
