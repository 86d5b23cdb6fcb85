"""The usage ledger's store (shunter.usage_ledger): one row per request id however often a batch is sent (a
refusal counter's larger count replacing its smaller), sums by the columns asked for within a window and per
bucket, cost from the model's pricing, nothing lost by closing and reopening the file or by two writers at once,
old rows deleted by retention, and a full file held in memory, summed, never raised, and written back."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sqlite3
import threading
from types import SimpleNamespace

import pytest

from shunter.config import PricingConfig
from shunter.usage_ledger import GROUP_COLUMNS, LedgerStore, UsageRecord, cost_of

PRICING = PricingConfig(input_per_million=2.0, cached_input_per_million=0.5, output_per_million=8.0)


def record(request_id: str, at: float = 100.0, key: str = "alice", model: str = "m", adapter: str = "",
           cls: str = "standard", endpoint: str = "chat", prompt: int = 10, cached: int = 0, completion: int = 5,
           cost: float | None = None, status: str = "200", requests: int = 1) -> UsageRecord:
    return UsageRecord(request_id=request_id, at=at, key_name=key, key_id=f"id-{key}", model=model, adapter=adapter,
                       priority_class=cls, endpoint=endpoint, status=status, prompt_tokens=prompt,
                       cached_tokens=cached, completion_tokens=completion, cost=cost, requests=requests)


def refusal(request_id: str, requests: int, at: float = 120.0, key: str = "alice", status: str = "429") -> UsageRecord:
    """A gateway's refusal counter: nothing used, `requests` refused so far in its minute."""
    return record(request_id, at=at, key=key, prompt=0, completion=0, status=status, requests=requests)


@pytest.fixture
def store(tmp_path):
    s = LedgerStore(tmp_path / "ledger" / "usage.sqlite3")
    yield s
    s.close()


def test_cost_prices_uncached_cached_and_completion_tokens_apart():
    assert cost_of(None, 100, 0, 100) is None
    assert cost_of(PRICING, 1_000_000, 0, 0) == pytest.approx(2.0)
    assert cost_of(PRICING, 1_000_000, 1_000_000, 0) == pytest.approx(0.5)
    assert cost_of(PRICING, 1000, 400, 250) == pytest.approx((600 * 2.0 + 400 * 0.5 + 250 * 8.0) / 1e6)
    same = PricingConfig(input_per_million=3.0, output_per_million=0.0)  # cached: null = the input price
    assert cost_of(same, 100, 100, 0) == cost_of(same, 100, 0, 0) == pytest.approx(300 / 1e6)
    assert cost_of(PRICING, 10, 50, 0) == pytest.approx(10 * 0.5 / 1e6), "never more cached than prompt tokens"


def test_a_record_crosses_the_wire_as_a_dict():
    r = record("a", cost=0.25)
    assert UsageRecord.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="unknown"):
        UsageRecord.from_dict({**r.to_dict(), "prompt": 1})


def test_the_store_makes_its_directory_and_uses_wal(tmp_path):
    path = tmp_path / "a" / "b" / "usage.sqlite3"
    s = LedgerStore(path)
    try:
        assert path.exists()
        assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s._db.execute("PRAGMA busy_timeout").fetchone()[0] > 0
        indexes = {row[1] for row in s._db.execute("PRAGMA index_list(usage)")}
        assert {"usage_at", "usage_key_at"} <= indexes
    finally:
        s.close()


def test_a_batch_sent_again_is_counted_once(store):
    batch = [record("a"), record("b"), record("c")]
    assert store.write(batch) == 3
    assert store.write(batch) == 0, "a batch resent after a lost reply adds nothing"
    assert store.write([record("c"), record("d")]) == 1, "a batch that overlaps adds only its new records"
    assert store.count() == 4
    assert store.write([]) == 0
    (row,) = store.query(group_by=())
    assert row["requests"] == 4 and row["prompt_tokens"] == 40 and row["completion_tokens"] == 20


def test_a_failing_batch_writes_nothing(store):
    bad = dataclasses.replace(record("y"), prompt_tokens=None)  # type: ignore[arg-type] - NOT NULL fails
    with pytest.raises(sqlite3.IntegrityError):
        store.write([record("x"), bad])
    assert store.count() == 0, "one transaction: all or nothing"
    assert store.write([record("x")]) == 1


def test_sums_group_by_the_columns_asked_for(store):
    store.write([
        record("1", key="alice", model="m", prompt=10, cached=4, completion=1, cost=1.0),
        record("2", key="alice", model="m", prompt=20, cached=0, completion=2, cost=2.0),
        record("3", key="alice", model="n", adapter="sql", prompt=5, completion=5),
        record("4", key="bob", model="m", cls="batch", endpoint="completions", prompt=7, completion=3, cost=0.5),
    ])
    rows = store.query()  # by key and model
    assert [(r["key"], r["model"]) for r in rows] == [("alice", "m"), ("alice", "n"), ("bob", "m")]
    alice_m = rows[0]
    assert (alice_m["requests"], alice_m["prompt_tokens"], alice_m["cached_tokens"],
            alice_m["completion_tokens"], alice_m["cost"]) == (2, 30, 4, 3, 3.0)
    assert rows[1]["cost"] is None, "no priced record in the row: no cost, not 0"
    by_class = store.query(group_by=["priority_class"])
    assert [(r["priority_class"], r["requests"]) for r in by_class] == [("batch", 1), ("standard", 3)]
    by_adapter = store.query(group_by=("model", "adapter"))
    assert [(r["model"], r["adapter"]) for r in by_adapter] == [("m", ""), ("n", "sql")]
    by_endpoint = store.query(group_by=("endpoint",))
    assert {r["endpoint"]: r["requests"] for r in by_endpoint} == {"chat": 3, "completions": 1}
    (everything,) = store.query(group_by=[])
    assert set(everything) == {"requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost",
                               "first_at", "last_at"}
    assert everything["cost"] == pytest.approx(3.5)
    assert store.query(group_by=GROUP_COLUMNS)[0].keys() >= set(GROUP_COLUMNS)
    with pytest.raises(ValueError, match="cannot group by"):
        store.query(group_by=("key", "key_id"))


def test_filters_and_windows(store):
    store.write([record("1", at=100.0), record("2", at=200.0), record("3", at=300.0, key="bob"),
                 record("4", at=300.0, model="n")])
    assert store.query(key="bob")[0]["requests"] == 1
    assert [r["model"] for r in store.query(model="n")] == ["n"]
    assert store.query(key="nobody") == []
    assert store.query(key="nobody", group_by=()) == [], "nothing matched: no row, not a row of zeros"
    (window,) = store.query(since=150.0, until=300.0, group_by=())  # [since, until)
    assert window["requests"] == 1 and window["first_at"] == window["last_at"] == 200.0
    (tail,) = store.query(since=200.0, group_by=())
    assert tail["requests"] == 3 and (tail["first_at"], tail["last_at"]) == (200.0, 300.0)
    (head,) = store.query(until=200.0, group_by=())
    assert head["requests"] == 1


def test_everything_survives_closing_and_reopening(tmp_path):
    path = tmp_path / "usage.sqlite3"
    first = LedgerStore(path)
    first.write([record(str(i), cost=0.125) for i in range(50)])
    first.close()
    again = LedgerStore(path)
    try:
        assert again.count() == 50
        assert again.write([record("7")]) == 0, "the ids written before the restart still count"
        (row,) = again.query(group_by=())
        assert row["cost"] == pytest.approx(50 * 0.125)
    finally:
        again.close()


def test_two_writers_at_once_lose_nothing(tmp_path):
    """Two threads on one store, and a second store on the same file in a third thread: every record is
    there once, overlapping batches included."""
    path = tmp_path / "usage.sqlite3"
    shared, beside = LedgerStore(path), LedgerStore(path)
    errors: list[BaseException] = []

    def writer(store: LedgerStore, prefix: str) -> None:
        try:
            for batch in range(40):
                ids = [f"{prefix}-{batch}-{i}" for i in range(25)]
                store.write([record(i) for i in ids])
                store.write([record(i) for i in ids[:5]])  # a resend in the middle of the others' writes
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(shared, "a")), threading.Thread(target=writer, args=(shared, "b")),
               threading.Thread(target=writer, args=(beside, "c"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        assert shared.count() == beside.count() == 3 * 40 * 25
    finally:
        shared.close()
        beside.close()


# ---- refusal counters ------------------------------------------------------------------------------------

def test_a_refusal_counter_is_one_row_whose_larger_count_wins(store):
    assert refusal("refused:g:0", 3).refusal and not record("a").refusal
    assert not record("z", prompt=0, completion=0).refusal, "a 200 that used nothing is a model request"
    assert store.write([record("a"), refusal("refused:g:0", 3)]) == 2
    assert store.write([refusal("refused:g:0", 3)]) == 0, "the same count sent again changes nothing"
    assert store.write([refusal("refused:g:0", 2)]) == 0, "a smaller count (an older batch) changes nothing"
    assert store.write([refusal("refused:g:0", 7), record("a")]) == 1, "the minute's later, larger count"
    assert store.count() == 2
    (row,) = store.query(group_by=())
    assert row["requests"] == 8 and row["prompt_tokens"] == 10, "requests are summed, not rows counted"
    with pytest.raises(ValueError, match="unknown"):
        UsageRecord.from_dict({**refusal("x", 1).to_dict(), "count": 1})
    assert UsageRecord.from_dict(refusal("x", 4).to_dict()).requests == 4


def test_a_file_from_before_refusal_counters_gains_the_requests_column(tmp_path):
    path = tmp_path / "usage.sqlite3"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE usage (request_id TEXT PRIMARY KEY, at REAL NOT NULL, key_name TEXT NOT NULL, "
                "key_id TEXT NOT NULL, model TEXT NOT NULL, adapter TEXT NOT NULL, priority_class TEXT NOT NULL, "
                "endpoint TEXT NOT NULL, status TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, "
                "cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, cost REAL)")
    old.execute("INSERT INTO usage VALUES ('old', 100, 'alice', 'id-alice', 'm', '', 'standard', 'chat', '429', "
                "0, 0, 0, NULL)")
    old.commit()
    old.close()
    s = LedgerStore(path)
    try:
        assert s.write([refusal("refused:g:0", 5)]) == 1
        (row,) = s.query(group_by=())
        assert row["requests"] == 6, "each old row is one request"
    finally:
        s.close()


# ---- retention -------------------------------------------------------------------------------------------

DAY = 86400.0
NOW = 1_800_000_000.0


class Clock:
    def __init__(self, now: float = NOW):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_retention_removes_old_rows_and_keeps_recent_ones(tmp_path):
    path = tmp_path / "usage.sqlite3"
    everything = LedgerStore(path)  # no retention: every row is kept
    everything.write([record("ancient", at=NOW - 400 * DAY), record("old", at=NOW - 100 * DAY),
                      refusal("refused:g:old", 9, at=NOW - 100 * DAY), record("recent", at=NOW - 30 * DAY + 3000),
                      refusal("refused:g:recent", 4, at=NOW - 30 * DAY + 3000)])
    everything.close()
    clock = Clock()
    s = LedgerStore(path, retention_days=30, clock=clock)
    try:
        (row,) = s.query(group_by=())
        assert s.count() == 2 and row["requests"] == 5, "at open: the rows past 30 days are gone, counters too"
        clock.now += 1800  # "recent" is 30 days and 10 minutes old now
        s.write([record("today", at=clock.now)])
        assert s.count() == 3, "less than an hour since the last pass: nothing deleted yet"
        clock.now += 1800
        s.write([record("later", at=clock.now)])
        assert s.query(group_by=())[0]["requests"] == 2
        assert s.count() == 2, "an hour after the last pass a write deletes what aged past the retention"
    finally:
        s.close()


# ---- a full file -------------------------------------------------------------------------------------------

def _fill(store: LedgerStore, at: float, prefix: str = "fill") -> int:
    """Write old rows until the file is full; returns how many it took."""
    for batch in range(1000):
        store.write([record(f"{prefix}-{batch}-{i}", at=at, key="old") for i in range(20)])
        if store.degraded:
            return batch * 20
    raise AssertionError("the file never filled")


def _totals(store: LedgerStore, **query) -> dict:
    return {(r["key"], r["model"]): (r["requests"], r["prompt_tokens"], r["completion_tokens"])
            for r in store.query(**query)}


def test_a_full_file_holds_usage_in_memory_exactly_and_never_raises(tmp_path, caplog):
    clock = Clock()
    s = LedgerStore(tmp_path / "usage.sqlite3", max_size_mb=0.05, clock=clock)  # 12 pages of 4 KiB
    caplog.set_level(logging.INFO, logger="ray.serve")
    try:
        in_file = _fill(s, at=NOW)
        assert s.degraded and s.held_total == 20, "the batch that did not fit is held, not raised"
        batches = [[record(f"b{b}-{i}", at=clock.now, key=f"k{i % 3}", prompt=7, completion=2) for i in range(50)]
                   for b in range(40)]
        for b, batch in enumerate(batches):
            assert s.write(batch) == 50
            assert s.write([refusal("refused:g:0", b + 1, at=clock.now, key="k0")]) in (0, 1)
            clock.now += 3  # past RETRY_S now and then: the file is tried again, and is still full
        assert s.write(batches[5]) == 0, "a batch sent again after a lost reply is not summed twice"
        assert s.write([record("fill-0-0", at=NOW, key="old")]) == 0, "nor a record the file already has"
        assert s.count() == in_file
        totals = _totals(s)
        assert totals[("old", "m")] == (in_file + 20, (in_file + 20) * 10, (in_file + 20) * 5)
        for k in ("k1", "k2"):
            assert totals[(k, "m")][1] == sum(7 for batch in batches for r in batch if r.key_name == k)
        assert totals[("k0", "m")][0] == sum(1 for batch in batches for r in batch if r.key_name == "k0") + 40, \
            "the refusal counter counts 40 (its largest count), not 1 + 2 + ... + 40"
        assert s.held.rows <= 3 * 3 + 1 + 1, "per minute and group: a few rows, not one per record"
        warnings = [r for r in caplog.records if "takes no writes" in r.getMessage()]
        assert len(warnings) == 1 and "max_size_mb=0.05" in warnings[0].getMessage(), "one line, not one a batch"
        (bucket,) = s.buckets(NOW, NOW + 3600, 3600, key="k0")
        assert bucket["requests"] == totals[("k0", "m")][0] - 40, "the Usage API reads what is held too"
    finally:
        s.close()


def test_held_usage_lands_in_the_file_once_retention_frees_it(tmp_path, caplog):
    clock = Clock()
    s = LedgerStore(tmp_path / "usage.sqlite3", retention_days=10, max_size_mb=0.05, clock=clock)
    caplog.set_level(logging.INFO, logger="ray.serve")
    try:
        _fill(s, at=NOW - 20 * DAY)  # old rows fill it (written in the last hour's pass: none yet past due)
        fresh = [record(f"new-{i}", at=NOW, key="new", prompt=3, completion=1) for i in range(200)]
        s.write(fresh[:100])
        s.write([refusal("refused:g:new", 6, at=NOW, key="new")])
        assert s.degraded and s.held.holding
        before = _totals(s, key="new")
        clock.now += 3601  # the next write runs retention, which deletes the old rows and frees their pages
        assert s.write(fresh[100:]) == 100
        assert not s.degraded and not s.held.holding
        assert _totals(s) == {("new", "m"): (206, 600, 200)}, "the held sums and counter, then the batch"
        assert before[("new", "m")] == (106, 300, 100)
        assert any("takes writes again" in r.getMessage() for r in caplog.records)
        assert s.write(fresh[:100]) == 0, "a record held, then written as part of a sum, is not written again"
        assert _totals(s)[("new", "m")] == (206, 600, 200)
    finally:
        s.close()


def test_closing_writes_what_is_held_and_a_larger_bound_keeps_it(tmp_path):
    path = tmp_path / "usage.sqlite3"
    s = LedgerStore(path, max_size_mb=0.05)
    in_file = _fill(s, at=NOW)
    s.write([record(f"x{i}", at=NOW + i) for i in range(300)])
    s.write([refusal("refused:g:0", 12, at=NOW)])
    expected = _totals(s)
    assert s.degraded and s.count() == in_file
    s.close()  # past its own bound: a stopping ledger does not drop a bill
    again = LedgerStore(path, max_size_mb=1.0)
    try:
        assert _totals(again) == expected and not again.held.holding
        assert again.write([record("after", at=NOW)]) == 1 and not again.degraded, "the larger bound has room"
    finally:
        again.close()


def test_held_usage_stays_within_its_bound_and_its_totals_exact(tmp_path):
    clock = Clock()
    s = LedgerStore(tmp_path / "usage.sqlite3", max_size_mb=0.05, clock=clock, max_held_rows=40)
    try:
        _fill(s, at=NOW - DAY)
        for minute in range(180):  # three hours, four keys: 720 minute-groups
            s.write([record(f"{minute}-{k}", at=NOW + minute * 60, key=f"k{k}", prompt=2, completion=1)
                     for k in range(4)])
            assert s.held.rows <= 40 + 4
        clock.now = NOW + 180 * 60
        totals = _totals(s)
        assert [totals[(f"k{k}", "m")] for k in range(4)] == [(180, 360, 180)] * 4, "coarser, never lost"
    finally:
        s.close()


# ---- buckets (the Usage API) -------------------------------------------------------------------------------

def test_buckets_sum_model_requests_per_width_and_group(store):
    store.write([
        record("1", at=1000, key="alice", prompt=10, cached=4, completion=1, cost=1.0),
        record("2", at=1059, key="alice", prompt=20, completion=2),
        record("3", at=1060, key="alice", model="m", adapter="sql", prompt=5, completion=5),
        record("4", at=1130, key="bob", model="n", prompt=7, completion=3, cost=0.5),
        record("5", at=1130, key="bob", model="n", status="499", prompt=7, completion=0),  # reached the engine
        refusal("refused:g:0", 50, at=1080, key="bob"),  # reached no model
        record("late", at=1180, key="bob"),  # past `until`
    ])
    rows = store.buckets(1000, 1180, 60)
    assert [(r["bucket"], r["requests"], r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"], r["cost"])
            for r in rows] == [(0, 2, 30, 4, 3, 1.0), (1, 1, 5, 0, 5, None), (2, 2, 14, 0, 3, 0.5)]
    by = store.buckets(1000, 1180, 120, group_by=("model", "key_id"))
    assert [(r["bucket"], r["model"], r["key_id"], r["requests"]) for r in by] == [
        (0, "m", "id-alice", 2), (0, "m:sql", "id-alice", 1), (1, "n", "id-bob", 2)], "an adapter as <model>:<adapter>"
    assert [r["requests"] for r in store.buckets(1000, 1180, 3600, key="bob")] == [2]
    assert store.buckets(1000, 1180, 3600, key_ids=["id-nobody"]) == []
    assert [r["requests"] for r in store.buckets(1000, 1180, 3600, models=["m:sql", "n"])] == [3]
    assert store.buckets(1000, 1180, 60, key_ids=[]) == [], "an empty filter matches nothing"
    with pytest.raises(ValueError, match="cannot group buckets"):
        store.buckets(0, 1, 60, group_by=("endpoint",))


# ---- the deployment ------------------------------------------------------------------------------------------

def test_the_deployment_exports_the_degraded_state_and_what_it_held(tmp_path, monkeypatch):
    from shunter.deployments.ledger import deployment

    seen: list[tuple[str, float]] = []
    metrics = {"shunter_usage_ledger_degraded": SimpleNamespace(set=lambda v, tags: seen.append(("degraded", v))),
               "shunter_usage_ledger_held_records_total": SimpleNamespace(inc=lambda v: seen.append(("held", v)))}
    monkeypatch.setattr(deployment, "_record", lambda fn: fn(metrics))
    ledger = deployment.UsageLedger.func_or_class(str(tmp_path / "usage.sqlite3"), 30, 0.05)
    assert seen == [("degraded", 0.0)]

    async def flood() -> None:
        for batch in range(1000):
            await ledger.record([record(f"{batch}-{i}", at=NOW).to_dict() for i in range(20)])
            if ledger.store.degraded:
                break
        await ledger.record([record("more", at=NOW).to_dict()])

    asyncio.run(flood())
    assert seen[-4:] == [("degraded", 1.0), ("held", 20), ("degraded", 1.0), ("held", 1)]
    assert set(seen[:-4]) == {("degraded", 0.0)}, "0 until the file was full"
    assert sum(v for name, v in seen if name == "held") == ledger.store.held_total == 21
    rows = asyncio.run(ledger.buckets(NOW, NOW + 60, 60))
    assert rows[0]["requests"] == ledger.store.count() + 21, "the Usage API's sums include what is held"
    ledger.__del__()
