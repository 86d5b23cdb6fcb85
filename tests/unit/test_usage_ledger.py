"""The usage ledger's store (shunter.usage_ledger): one row per request id however often a batch is sent, sums
by the columns asked for within a window, cost from the model's pricing, and nothing lost by closing and
reopening the file or by two writers at once."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading

import pytest

from shunter.config import PricingConfig
from shunter.usage_ledger import GROUP_COLUMNS, LedgerStore, UsageRecord, cost_of

PRICING = PricingConfig(input_per_million=2.0, cached_input_per_million=0.5, output_per_million=8.0)


def record(request_id: str, at: float = 100.0, key: str = "alice", model: str = "m", adapter: str = "",
           cls: str = "standard", endpoint: str = "chat", prompt: int = 10, cached: int = 0, completion: int = 5,
           cost: float | None = None, status: str = "200") -> UsageRecord:
    return UsageRecord(request_id=request_id, at=at, key_name=key, key_id=f"id-{key}", model=model, adapter=adapter,
                       priority_class=cls, endpoint=endpoint, status=status, prompt_tokens=prompt,
                       cached_tokens=cached, completion_tokens=completion, cost=cost)


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
