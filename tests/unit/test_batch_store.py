"""The Batch API's store on SQLite: files per owner, a batch's lines each finished once, OpenAI's shapes.
(The same code on a real PostgreSQL: tests/integration.)"""

from __future__ import annotations

import threading

import pytest

from shunter.batch_store import JobStore

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


@pytest.fixture
def store_url(tmp_path) -> str:
    """Where the store keeps its state: a SQLite file here (a folder made on first use); a fresh database
    on a real PostgreSQL in tests/integration/test_batch_store_postgres.py, which runs these tests again."""
    return str(tmp_path / "state" / "batch.db")


@pytest.fixture
def store(store_url):
    s = JobStore(store_url, clock=Clock())
    yield s
    s.close()


def test_an_owner_sees_only_its_own_files_and_an_admin_sees_every_one(store):
    mine = store.add_file("key-a", "in.jsonl", "batch", 120)
    theirs = store.add_file("key-b", "other.jsonl", "batch", 80)
    assert store.get_file(mine.id, "key-a") == mine
    assert store.get_file(mine.id, "key-b") is None, "another key learns nothing of it"
    assert store.get_file(theirs.id, None) == theirs, "the admin sees it"
    files, more = store.list_files("key-a")
    assert [f.id for f in files] == [mine.id] and not more
    assert mine.to_openai()["object"] == "file" and mine.to_openai()["bytes"] == 120
    assert not store.delete_file(mine.id, "key-b"), "not theirs to delete"
    assert store.delete_file(mine.id, "key-a") and store.get_file(mine.id, "key-a") is None
    assert not store.delete_file(mine.id, "key-a"), "deleted once"


def test_files_are_listed_newest_first_a_page_at_a_time(store):
    store.clock = lambda: 1_800_000_000.0  # all in one second: the order is still the upload order
    ids = [store.add_file("k", f"{i}.jsonl", "batch", i).id for i in range(5)]
    page, more = store.list_files("k", limit=2)
    assert [f.id for f in page] == ids[::-1][:2] and more
    page, more = store.list_files("k", limit=2, after=page[-1].id)
    assert [f.id for f in page] == ids[::-1][2:4] and more
    page, more = store.list_files("k", limit=2, after=page[-1].id)
    assert [f.id for f in page] == [ids[0]] and not more
    oldest, _ = store.list_files("k", limit=2, newest_first=False)
    assert [f.id for f in oldest] == ids[:2]


def _batch_with_lines(store, lines=4, invalid=(2,)):
    batch = store.create_batch("k", "file-x", "/v1/chat/completions", "24h", 86400, {"job": "nightly"})
    store.add_lines(batch.id, [
        (n, f"req-{n}", None if n in invalid else {"model": "m", "messages": []},
         {"id": f"batch_req_{n}", "custom_id": f"req-{n}", "response": None,
          "error": {"code": "invalid_body", "message": "bad"}} if n in invalid else None)
        for n in range(1, lines + 1)])
    return batch


def test_a_batch_goes_through_openais_statuses_stamping_each(store):
    batch = _batch_with_lines(store)
    assert batch.to_openai()["status"] == "validating" and batch.expires_at == batch.created_at + 86400
    assert store.set_status(batch.id, "in_progress", only_from=["validating"])
    assert not store.set_status(batch.id, "in_progress", only_from=["validating"]), "only once"
    got = store.get_batch(batch.id, "k")
    assert got.status == "in_progress" and got.times["in_progress_at"] is not None
    assert got.counts == {"total": 4, "completed": 0, "failed": 1}, "an invalid line is failed from the start"
    assert store.get_batch(batch.id, "other") is None
    body = got.to_openai()
    assert body["object"] == "batch" and body["metadata"] == {"job": "nightly"} and body["errors"] is None
    assert body["request_counts"] == {"total": 4, "completed": 0, "failed": 1}
    with pytest.raises(ValueError):
        store.set_status(batch.id, "done")


def test_each_line_is_finished_once_and_the_results_come_in_input_order(store):
    batch = _batch_with_lines(store)
    pending = store.pending_lines(batch.id, 10)
    assert [p.line for p in pending] == [1, 3, 4] and pending[0].request == {"model": "m", "messages": []}
    assert [p.line for p in store.pending_lines(batch.id, 1, skip=[1])] == [3], "the running ones are skipped"
    store.started_line(batch.id, 4)
    assert store.pending_lines(batch.id, 10, skip=[1, 3])[0].attempts == 1
    assert store.finish_line(batch.id, 4, {"custom_id": "req-4", "n": 1}, ok=True)
    assert not store.finish_line(batch.id, 4, {"custom_id": "req-4", "n": 2}, ok=True), "a second run is dropped"
    assert store.finish_line(batch.id, 1, {"custom_id": "req-1"}, ok=True)
    assert store.finish_line(batch.id, 3, {"custom_id": "req-3", "error": "x"}, ok=False)
    assert store.pending_lines(batch.id, 10) == []
    assert store.results(batch.id, ok=True) == [{"custom_id": "req-1"}, {"custom_id": "req-4", "n": 1}]
    assert [r["custom_id"] for r in store.results(batch.id, ok=False)] == ["req-2", "req-3"]
    assert store.counts(batch.id) == {"total": 4, "completed": 2, "failed": 2}


def test_racing_runners_finish_a_line_once(store):
    batch = _batch_with_lines(store, lines=1, invalid=())
    wins = []

    def finish(n: int) -> None:
        wins.append(store.finish_line(batch.id, 1, {"by": n}, ok=True))

    threads = [threading.Thread(target=finish, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins.count(True) == 1 and store.counts(batch.id)["completed"] == 1


def test_the_state_outlives_the_store_that_wrote_it(store_url):
    first = JobStore(store_url)
    batch = _batch_with_lines(first)
    first.finish_line(batch.id, 1, {"custom_id": "req-1"}, ok=True)
    first.close()
    again = JobStore(store_url)
    try:
        assert again.get_batch(batch.id, None).counts == {"total": 4, "completed": 1, "failed": 1}
        assert [p.line for p in again.pending_lines(batch.id, 10)] == [3, 4]
    finally:
        again.close()


def test_batches_are_listed_newest_first_per_owner(store):
    first = store.create_batch("k", "file-1", "/v1/embeddings", "24h", 86400)
    second = store.create_batch("k", "file-2", "/v1/embeddings", "24h", 86400)
    store.create_batch("other", "file-3", "/v1/embeddings", "24h", 86400)
    listed, more = store.list_batches("k", limit=1)
    assert [b.id for b in listed] == [second.id] and more
    listed, more = store.list_batches("k", limit=1, after=second.id)
    assert [b.id for b in listed] == [first.id] and not more
    assert len(store.list_batches(None)[0]) == 3
