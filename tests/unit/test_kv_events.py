"""The replica's view of its engine's KV cache (shunter.kv_events): the block index from vLLM's event
types, router keys linked to token blocks, and the subscriber against vLLM's real ZeroMQ publisher
(ipc sockets in tmp_path; no engine, no Ray): normal flow, lost batches filled by replay, and losses that
cannot be filled."""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from shunter.kv_events import (
    KVBlockIndex,
    KVEventSubscriber,
    PrefixLinks,
    block_digest,
    engine_kv_events_config,
    ipc_endpoints,
)

pytestmark = pytest.mark.unit

BS = 4  # block size of the index tests: short token lists


def _stored(hashes: list, tokens: list[int], parent=None, lora: str | None = None, size: int = BS,
            salt: str | None = None) -> BlockStored:
    """As vLLM publishes it: each block's extra keys untagged, the LoRA name on every block, the cache salt
    on a sequence's first block only."""
    extra = [tuple(k for k in (lora, salt if parent is None and i == 0 else None) if k) or None
             for i in range(len(hashes))]
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size,
                       lora_id=None, medium="GPU", lora_name=lora,
                       extra_keys=extra if any(extra) else None)


def _removed(*hashes) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


def _batch(*events) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events))


def _digests(tokens: list[int], size: int = BS) -> list[bytes]:
    return [block_digest(tokens[i : i + size]) for i in range(0, len(tokens) - size + 1, size)]


def _until(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


PROMPT = list(range(100, 112))  # three blocks


def test_block_digest_is_blake2b_8_of_little_endian_uint32():
    tokens = [1, 2, 70_000, 2**32 - 1]
    assert block_digest(tokens) == hashlib.blake2b(struct.pack("<4I", *tokens), digest_size=8).digest()
    assert block_digest([1, 2, 3, 4]) != block_digest([1, 2, 4, 3])


def test_stored_blocks_are_found_by_content_and_depth_stops_at_the_first_unknown_block():
    index = KVBlockIndex(BS)
    index.apply(_batch(_stored([11, 12, 13], PROMPT)))
    assert index.blocks == 3 and index.stored == 3
    assert index.held_depth(_digests(PROMPT), None) == 3
    assert index.held_depth(_digests(PROMPT[:8]), None) == 2
    other_tail = PROMPT[:8] + [1, 2, 3, 4]
    assert index.held_depth(_digests(other_tail), None) == 2
    assert index.held_depth(_digests([9] * 4 + PROMPT[4:]), None) == 0  # same later blocks, other head
    # A continuation stored later, linked by the parent's engine hash (bytes hashes work the same).
    index.apply(_batch(_stored([b"\x01" * 32], [5, 6, 7, 8], parent=13)))
    assert index.held_depth(_digests(PROMPT + [5, 6, 7, 8]), None) == 4


def test_duplicate_stores_are_reference_counted():
    index = KVBlockIndex(BS)
    index.apply(_batch(_stored([11, 12], PROMPT[:8])))
    index.apply(_batch(_stored([12], PROMPT[4:8], parent=11)))  # a second physical block, same hash
    assert index.blocks == 2
    index.apply(_batch(_removed(12)))
    assert index.held_depth(_digests(PROMPT[:8]), None) == 2
    index.apply(_batch(_removed(12)))
    assert index.held_depth(_digests(PROMPT[:8]), None) == 1 and index.blocks == 1


def test_removals_of_unknown_hashes_are_ignored_and_a_removed_middle_block_cuts_the_chain():
    index = KVBlockIndex(BS)
    index.apply(_batch(_stored([11, 12, 13], PROMPT), _removed(99, b"nope")))
    assert index.removed == 0 and index.blocks == 3
    index.apply(_batch(_removed(12)))
    assert index.removed == 1 and index.blocks == 2
    assert index.held_depth(_digests(PROMPT), None) == 1


def test_clears_empty_the_view_and_count_epochs():
    index = KVBlockIndex(BS)
    index.apply(_batch(_stored([11, 12, 13], PROMPT)))
    index.exact = False
    index.apply(_batch(AllBlocksCleared()))
    assert index.blocks == 0 and index.held_depth(_digests(PROMPT), None) == 0
    assert index.epoch == 1 and index.exact  # the engine is empty: nothing is missing
    index.apply(_batch(_stored([11], PROMPT[:4])))
    index.clear()
    assert index.blocks == 0 and index.epoch == 2 and index.cleared == 2


def test_the_same_tokens_under_two_adapters_are_two_chains():
    index = KVBlockIndex(BS)
    index.apply(_batch(_stored([21, 22, 23], PROMPT, lora="a")))
    assert index.held_depth(_digests(PROMPT), "a") == 3
    assert index.held_depth(_digests(PROMPT), None) == 0
    assert index.held_depth(_digests(PROMPT), "b") == 0
    index.apply(_batch(_stored([11, 12], PROMPT[:8])))
    assert index.held_depth(_digests(PROMPT), None) == 2 and index.held_depth(_digests(PROMPT), "a") == 3


def test_the_same_tokens_under_two_cache_salts_are_two_chains():
    """Two tenants' equal prompts (the gateway salts each key's requests) are two chains, as in the engine."""
    index = KVBlockIndex(BS)
    index.apply(_batch(_stored([21, 22, 23], PROMPT, salt="tenant-a")))
    assert index.held_depth(_digests(PROMPT), None, "tenant-a") == 3
    assert index.held_depth(_digests(PROMPT), None, "tenant-b") == 0
    assert index.held_depth(_digests(PROMPT), None) == 0
    index.apply(_batch(_stored([31, 32, 33], PROMPT, lora="a", salt="tenant-b")))
    assert index.held_depth(_digests(PROMPT), "a", "tenant-b") == 3
    assert index.held_depth(_digests(PROMPT), "a", "tenant-a") == 0 and index.held_depth(_digests(PROMPT), "a") == 0
    links = PrefixLinks(max_keys=16)
    links.link([b"k"], chars=48, chunk_chars=16, token_ids=PROMPT, block_size=BS, lora_name=None,
               cache_salt="tenant-b")
    assert links.held_keys(index) == [], "tenant-b's blocks without the adapter: not held"
    links.link([b"k"], chars=48, chunk_chars=16, token_ids=PROMPT, block_size=BS, lora_name=None,
               cache_salt="tenant-a")
    assert links.held_keys(index) == [b"k"]


def test_a_block_whose_parent_is_unknown_counts_once_the_parent_is_stored_again():
    index = KVBlockIndex(BS)
    index.apply(_batch(_stored([13], PROMPT[8:], parent=12)))  # the parent's store was never seen
    assert index.blocks == 1 and index.held_depth(_digests(PROMPT), None) == 0
    index.apply(_batch(_stored([11, 12], PROMPT[:8])))  # same content, same engine hashes
    assert index.held_depth(_digests(PROMPT), None) == 3


def test_the_events_block_size_cuts_the_tokens():
    index = KVBlockIndex(8)
    index.apply(_batch(_stored([1, 2], list(range(16)), size=8)))
    assert index.held_depth(_digests(list(range(16)), 8), None) == 2
    assert index.held_depth(_digests(list(range(16)), 4), None) == 0


# --- PrefixLinks -----------------------------------------------------------------------------------------

KEYS = [bytes([k]) * 12 for k in range(4)]


def _held_prefix(tokens: list[int], blocks: int, size: int = 128, lora: str | None = None) -> KVBlockIndex:
    """An index holding the first `blocks` blocks of `tokens` (engine hashes 1000, 1001, ...)."""
    index = KVBlockIndex(size)
    index.apply(_batch(_stored(list(range(1000, 1000 + blocks)), tokens[: blocks * size], lora=lora,
                               size=size)))
    return index


@pytest.mark.parametrize(("tokens", "held_blocks", "held"), [
    (512, 4, 4),  # 4 chars a token: key j needs j+1 blocks
    (512, 2, 2),
    (1024, 4, 2),  # 2 chars a token: key j needs 2(j+1) blocks
    (1024, 5, 2),
    (1024, 8, 4),
    (300, 1, 3),  # 6.8 chars a token, 2 whole blocks: needs 1, 1, 1, 2 (0.59 -> at least 1; 2.34 -> 2)
    (300, 2, 4),
])
def test_keys_stand_for_their_share_of_the_tokens(tokens: int, held_blocks: int, held: int):
    prompt = list(range(tokens))
    links = PrefixLinks(100)
    links.link(KEYS, chars=4 * 512, chunk_chars=512, token_ids=prompt, block_size=128, lora_name=None)
    assert sorted(links.held_keys(_held_prefix(prompt, held_blocks))) == KEYS[:held]


def test_a_prompt_shorter_than_a_block_links_nothing_and_drops_older_links():
    links = PrefixLinks(100)
    links.link(KEYS[:1], chars=512, chunk_chars=512, token_ids=list(range(128)), block_size=128, lora_name=None)
    assert len(links) == 1
    links.link(KEYS[:1], chars=512, chunk_chars=512, token_ids=list(range(100)), block_size=128, lora_name=None)
    assert len(links) == 0


def test_evicting_a_middle_block_unholds_the_later_keys():
    prompt = list(range(512))
    index = _held_prefix(prompt, 4)
    links = PrefixLinks(100)
    links.link(KEYS, chars=2048, chunk_chars=512, token_ids=prompt, block_size=128, lora_name=None)
    index.apply(_batch(_removed(1001)))
    assert links.held_keys(index) == [KEYS[0]]


def test_links_follow_the_adapter():
    prompt = list(range(512))
    links = PrefixLinks(100)
    links.link(KEYS, chars=2048, chunk_chars=512, token_ids=prompt, block_size=128, lora_name="a")
    assert links.held_keys(_held_prefix(prompt, 4)) == []
    assert len(links.held_keys(_held_prefix(prompt, 4, lora="a"))) == 4


def test_links_are_an_lru_bounded_by_max_keys_that_drops_tails_first():
    first, second = list(range(512)), list(range(5000, 5512))
    links = PrefixLinks(5)
    other = [bytes([9, k]) * 6 for k in range(4)]
    links.link(KEYS, chars=2048, chunk_chars=512, token_ids=first, block_size=128, lora_name=None)
    links.link(other, chars=2048, chunk_chars=512, token_ids=second, block_size=128, lora_name=None)
    assert len(links) == 5
    assert links.held_keys(_held_prefix(first, 4)) == [KEYS[0]]  # the first request's head survived
    assert sorted(links.held_keys(_held_prefix(second, 4))) == sorted(other)


def test_a_key_linked_again_is_refreshed_and_takes_the_newer_link():
    a, b, c = list(range(256)), list(range(1000, 1256)), list(range(2000, 2256))
    links = PrefixLinks(4)
    links.link(KEYS[:2], chars=1024, chunk_chars=512, token_ids=a, block_size=128, lora_name=None)
    links.link(KEYS[2:], chars=1024, chunk_chars=512, token_ids=b, block_size=128, lora_name=None)
    links.link(KEYS[:2], chars=1024, chunk_chars=512, token_ids=c, block_size=128, lora_name=None)  # refresh
    new = [bytes([7, k]) * 6 for k in range(2)]
    links.link(new, chars=1024, chunk_chars=512, token_ids=b, block_size=128, lora_name=None)
    assert set(links.held_keys(_held_prefix(b, 2))) == set(new)  # KEYS[2:] were the oldest: gone
    assert links.held_keys(_held_prefix(a, 2)) == []  # the older link of KEYS[:2] is replaced
    assert set(links.held_keys(_held_prefix(c, 2))) == set(KEYS[:2])
    links.clear()
    assert len(links) == 0


# --- KVEventSubscriber against vLLM's publisher -----------------------------------------------------------


class Publisher:
    """vLLM's publisher, counting what it was given: the engine numbers its batches 0, 1, ... in order."""

    def __init__(self, tmp_path, replay: bool = True, buffer_steps: int = 100):
        self.zmq = ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/p", buffer_steps=buffer_steps,
                                     replay_endpoint=f"ipc://{tmp_path}/r" if replay else None, topic="kv")
        self.sent = 0
        self.closed = False

    def close(self) -> None:
        if not self.closed:  # vLLM's shutdown waits out its timeout when called twice
            self.closed = True
            self.zmq.shutdown()

    def publish(self, *events) -> int:
        """Publish one batch; returns its number."""
        self.zmq.publish(_batch(*events))
        self.sent += 1
        return self.sent - 1


@pytest.fixture
def make(tmp_path) -> Iterator[Callable[..., tuple[Publisher, KVEventSubscriber]]]:
    started: list = []

    def make(replay: bool = True, buffer_steps: int = 100, sub_replay: str | None = "same",
             resync_after_s: float = 30.0) -> tuple[Publisher, KVEventSubscriber]:
        publisher = Publisher(tmp_path, replay, buffer_steps)
        replay_endpoint = f"ipc://{tmp_path}/r" if sub_replay == "same" else sub_replay
        subscriber = KVEventSubscriber(f"ipc://{tmp_path}/p", KVBlockIndex(BS), replay_endpoint, topic="kv",
                                       resync_after_s=resync_after_s, replay_timeout_s=0.3)
        started.extend([publisher, subscriber])
        return publisher, subscriber

    yield make
    for thing in started:
        thing.close() if isinstance(thing, Publisher) else thing.stop()


def _join(publisher: Publisher, subscriber: KVEventSubscriber) -> None:
    """PUB drops what it sends before the SUB has joined: probe with empty batches until one arrives, then
    wait until every probe is in."""
    end = time.monotonic() + 3.0
    while subscriber.stats()["batches"] == 0:
        assert time.monotonic() < end, "the subscriber never joined"
        publisher.publish()
        time.sleep(0.02)
    _until(lambda: subscriber.stats()["last_seq"] == publisher.sent - 1)


def test_subscriber_follows_the_publisher(make):
    publisher, subscriber = make()
    began = time.time()  # before any batch: a batch's lag cannot be longer than what passed since
    subscriber.start()
    _join(publisher, subscriber)
    gaps = subscriber.stats()["gaps"]
    publisher.publish(_stored([11, 12, 13], PROMPT))
    publisher.publish(_stored([14], [1, 2, 3, 4], parent=12), _stored([14], [1, 2, 3, 4], parent=12))
    last = publisher.publish(_removed(14), _removed(13))
    _until(lambda: subscriber.stats()["last_seq"] == last)
    index = subscriber.index
    assert index.held_depth(_digests(PROMPT), None) == 2
    assert index.held_depth(_digests(PROMPT[:8] + [1, 2, 3, 4]), None) == 3  # one of two copies is left
    stats = subscriber.stats()
    assert stats["gaps"] == gaps and stats["losses"] == 0 and stats["exact"] and stats["blocks"] == 3
    lag = subscriber.take_lag()
    assert 0 < lag <= time.time() - began, "a lag in seconds, from a batch's publishing to its applying"
    assert subscriber.take_lag() == 0.0, "taken: the next reading starts afresh"
    subscriber.stop()
    subscriber.stop()  # twice is fine
    assert not subscriber._thread.is_alive()


def test_batches_published_before_the_subscriber_joined_are_replayed_from_zero(make):
    publisher, subscriber = make()
    publisher.publish(_stored([11, 12], PROMPT[:8]))
    publisher.publish(_stored([13], PROMPT[8:], parent=12))
    time.sleep(0.05)  # published to nobody
    subscriber.start()
    _join(publisher, subscriber)
    stats = subscriber.stats()
    assert stats["gaps"] >= 1 and stats["replays"] >= 1 and stats["losses"] == 0 and stats["exact"]
    assert subscriber.index.held_depth(_digests(PROMPT), None) == 3


def test_a_batch_lost_midstream_is_filled_by_replay(make):
    publisher, subscriber = make()
    subscriber.start()
    _join(publisher, subscriber)
    gaps, replays = subscriber.stats()["gaps"], subscriber.stats()["replays"]
    subscriber._drop_next_for_test = 1
    publisher.publish(_stored([11, 12], PROMPT[:8]))  # dropped on the SUB side
    last = publisher.publish(_stored([13], PROMPT[8:], parent=12))
    _until(lambda: subscriber.stats()["last_seq"] == last)
    stats = subscriber.stats()
    assert stats["gaps"] == gaps + 1 and stats["replays"] == replays + 1
    assert stats["losses"] == 0 and stats["exact"]
    assert subscriber.index.held_depth(_digests(PROMPT), None) == 3


def test_an_overflowed_replay_buffer_clears_the_view_until_it_has_had_time_to_refill(make):
    publisher, subscriber = make(buffer_steps=2, resync_after_s=0.5)
    for i in range(5):
        publisher.publish(_stored([i], [i] * 4))
    time.sleep(0.05)
    subscriber.start()
    _join(publisher, subscriber)
    stats = subscriber.stats()
    assert stats["losses"] == 1 and not stats["exact"] and stats["blocks"] == 0 and stats["epoch"] == 1
    publisher.publish(_stored([11, 12, 13], PROMPT))
    _until(lambda: subscriber.index.held_depth(_digests(PROMPT), None) == 3)  # new events still count
    assert not subscriber.index.exact
    _until(lambda: subscriber.index.exact)


@pytest.mark.parametrize("sub_replay", [None, "dead"])
def test_without_an_answering_replay_socket_a_gap_is_a_loss(make, tmp_path, sub_replay):
    publisher, subscriber = make(replay=False, sub_replay=sub_replay and f"ipc://{tmp_path}/nobody")
    publisher.publish(_stored([11], PROMPT[:4]))
    time.sleep(0.05)
    subscriber.start()
    _join(publisher, subscriber)
    stats = subscriber.stats()
    assert stats["losses"] == 1 and not stats["exact"]
    assert stats["replays"] == (0 if sub_replay is None else 1)


def test_numbers_going_back_mean_a_new_engine_with_an_empty_cache(make, tmp_path):
    publisher, subscriber = make()
    subscriber.start()
    _join(publisher, subscriber)
    publisher.publish(_stored([11, 12, 13], PROMPT))
    for _ in range(50):  # the new engine's numbers must not catch up before the SUB has reconnected
        last = publisher.publish()
    _until(lambda: subscriber.stats()["last_seq"] == last)
    assert subscriber.index.blocks == 3
    publisher.close()
    restarted = Publisher(tmp_path)
    try:
        end = time.monotonic() + 3.0
        while subscriber.stats()["restarts"] == 0:
            assert time.monotonic() < end and restarted.sent < 50, "the restart went unnoticed"
            restarted.publish()
            time.sleep(0.02)
        assert subscriber.index.blocks == 0 and subscriber.stats()["losses"] == 0
    finally:
        restarted.close()


def test_stop_before_start_does_not_hang():
    subscriber = KVEventSubscriber("ipc:///nonexistent/x", KVBlockIndex(BS))
    subscriber.stop()
    subscriber.stop()


def test_engine_config_and_endpoints():
    pub, replay = ipc_endpoints("shunter-kv-" + "x" * 200)
    assert pub.startswith("ipc://" + tempfile.gettempdir() + os.sep) and replay.startswith("ipc://")
    assert pub != replay and len(pub) < 100 and len(replay) < 100 and ipc_endpoints("a") != ipc_endpoints("a")
    config = engine_kv_events_config(pub, replay)
    assert (config.enable_kv_cache_events, config.publisher, config.endpoint, config.replay_endpoint,
            config.topic) == (True, "zmq", pub, replay, "kv")


# ---- the replica's hook into vLLM's generate -------------------------------------------------------------


def test_only_a_requests_first_prompt_is_observed_and_a_hang_up_closes_the_engines_stream():
    import asyncio
    from types import SimpleNamespace

    from shunter.kv_events import observing_prompts, prompt_observer

    closed: list[str] = []

    async def generate(prompt, params, request_id, lora_request=None):
        try:
            for step in range(3):
                yield SimpleNamespace(prompt_token_ids=prompt, step=step)
        finally:
            closed.append(request_id)

    async def run() -> list[tuple[list[int], str | None]]:
        seen: list[tuple[list[int], str | None]] = []
        observed = observing_prompts(generate)

        async def request() -> None:  # one request's task, as the replica runs it
            prompt_observer.set(lambda tokens, lora: seen.append((list(tokens), lora)))
            first = observed([1, 2, 3], None, "a", lora_request=SimpleNamespace(lora_name="legal"))
            second = observed([7, 8], None, "b")  # a batch's second prompt
            async for _ in second:
                pass
            async for _ in first:
                break  # the client hangs up after one output
            await first.aclose()

        await asyncio.create_task(request())
        assert prompt_observer.get() is None, "the observer stays with the request's task"
        return seen

    assert asyncio.run(run()) == [([1, 2, 3], "legal")]
    assert sorted(closed) == ["a", "b"], "closing the wrapper closes vLLM's stream (which aborts the request)"
