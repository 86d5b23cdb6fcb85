"""What a replica's engine really holds in its KV cache, from the engine's own KV-cache events, told in the
router's prefix keys.

The router keys a prompt by character chunks of its canonical text (no tokenizer at the router) and
believes a replica holds what it sent there. That belief misses evictions, engine restarts and requests
sent by other routers. vLLM can publish every change to its prefix cache (`KVEventsConfig`: a ZeroMQ PUB
socket, plus a ROUTER socket that replays recent batches), so each replica listens to its own engine and
translates:

- `KVBlockIndex` mirrors the engine's cached blocks. A block is found by its content (its parent's engine
  hash, the LoRA adapter, a digest of its token ids), so the replica never needs vLLM's hash function,
  seed or pickling: the engine's hashes are only opaque links from a block to its parent. vLLM does not
  de-duplicate: two requests that fill identical blocks hold two blocks with one hash, stored and later
  removed twice, so each hash is reference-counted. Memory is bounded by the engine's KV blocks.
- `PrefixLinks` remembers, for the requests this replica served, which token blocks each of their router
  keys stands for (text and tokens are mapped proportionally: the router's canonical text is not the
  engine's exact text), so the replica can report the keys whose blocks the engine still holds.
- `KVEventSubscriber` keeps an index current from a background thread. The engine numbers its batches;
  a gap is filled from the replay socket, and when it cannot be (the replay buffer overflowed, no replay
  socket, no answer) the view is cleared and marked inexact, so the router falls back to its own belief
  until the view has had time to fill again.

Only plain decoder models are meant: one KV-cache group, whole blocks only (vLLM never emits partial
blocks for them). A sequence's first block is found under its extra keys as the event publishes them (the
LoRA name, then the request's `cache_salt`: the gateway salts every key's requests, so two tenants' equal
prompts are two chains here as in the engine); later blocks hang off their parent's hash, which the salt
already changed. Multimodal extra keys are not modelled. Like engine.py, this imports vLLM only inside
functions.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from contextvars import ContextVar
from typing import Any

log = logging.getLogger(__name__)

DIGEST_BYTES = 8
_UINT32 = "I" if array("I").itemsize == 4 else "L"  # the typecode of a 4-byte unsigned int here
_END_SEQ = -1  # the replay socket's end marker (signed)
_POLL_S = 0.1  # how long the thread waits on a socket before it looks at its stop flag again


def block_digest(tokens: Sequence[int]) -> bytes:
    """An 8-byte digest of one block's token ids (packed as little-endian uint32)."""
    packed = array(_UINT32, tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return hashlib.blake2b(packed.tobytes(), digest_size=DIGEST_BYTES).digest()


# (parent's engine hash, or for a first block its extra keys (`first_block_root`); LoRA name; token digest)
ContentKey = tuple[Hashable | None, str | None, bytes]


def first_block_root(lora_name: str | None, cache_salt: str | None) -> tuple[str, ...] | None:
    """What stands in for the parent of a sequence's first block: its extra keys, in the order vLLM's
    BlockStored event lists them untagged (LoRA name, then cache salt), None without either."""
    root = tuple(k for k in (lora_name, cache_salt) if k)
    return root or None


class KVBlockIndex:
    """The engine's cached blocks, from its events. `apply` runs on the subscriber's thread and the
    queries on the replica's event loop, so every access holds a lock (briefly: one batch, one chain)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.epoch = 0  # +1 on every clear: a consumer can tell a view rebuilt from scratch
        # False while the view may lack blocks the engine holds (events were lost); consumers report it.
        self.exact = True
        self.stored = 0  # blocks stored, duplicates included
        self.removed = 0  # removals of known blocks
        self.cleared = 0
        self._lock = threading.Lock()
        self._content: dict[ContentKey, Hashable] = {}  # content -> engine hash
        self._held: dict[Hashable, list[Any]] = {}  # engine hash -> [refcount, content key]

    @property
    def blocks(self) -> int:
        """Distinct blocks held."""
        return len(self._held)

    def apply(self, batch: Any) -> int:
        """Apply one decoded `KVEventBatch`; returns how many events it had."""
        with self._lock:
            for event in batch.events:
                # The class name is the union's tag on the wire, the schema's own discriminator; matching
                # it spares this module a vLLM import. Kinds a later vLLM adds are ignored.
                kind = type(event).__name__
                if kind == "BlockStored":
                    self._store(event)
                elif kind == "BlockRemoved":
                    self._remove(event.block_hashes)
                elif kind == "AllBlocksCleared":
                    self._clear()
                    self.exact = True  # the engine itself is empty now: nothing is missing from the view
        return len(batch.events)

    def _store(self, event: Any) -> None:
        size, tokens, lora = event.block_size, event.token_ids, event.lora_name
        parent = event.parent_block_hash  # None: the first block of a sequence
        if parent is None:
            extra = getattr(event, "extra_keys", None)
            first = extra[0] if extra else None
            parent = tuple(first) if first else None
        for i, engine_hash in enumerate(event.block_hashes):
            block = tokens[i * size : (i + 1) * size]
            if len(block) < size:
                break  # a malformed event: only whole blocks have hashes
            key = (parent, lora, block_digest(block))
            entry = self._held.get(engine_hash)
            if entry is None:
                self._held[engine_hash] = [1, key]
            else:
                entry[0] += 1
            self._content[key] = engine_hash
            self.stored += 1
            parent = engine_hash

    def _remove(self, hashes: Sequence[Hashable]) -> None:
        for engine_hash in hashes:
            entry = self._held.get(engine_hash)
            if entry is None:
                continue  # stored before this view began (a loss, a late start): nothing to undo
            self.removed += 1
            entry[0] -= 1
            if entry[0] <= 0:
                del self._held[engine_hash]
                if self._content.get(entry[1]) == engine_hash:
                    del self._content[entry[1]]

    def held_depth(self, digests: Sequence[bytes], lora_name: str | None, cache_salt: str | None = None) -> int:
        """How many leading blocks of a token chain (its block digests, in order) the engine holds."""
        with self._lock:
            parent: Hashable | None = first_block_root(lora_name, cache_salt)
            depth = 0
            for digest in digests:
                parent = self._content.get((parent, lora_name, digest))
                if parent is None:
                    break
                depth += 1
            return depth

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        self._content.clear()
        self._held.clear()
        self.epoch += 1
        self.cleared += 1


class _Chain:
    """One served request's prompt blocks, shared by its keys (compared by identity)."""

    __slots__ = ("cache_salt", "digests", "lora_name")

    def __init__(self, digests: tuple[bytes, ...], lora_name: str | None, cache_salt: str | None = None):
        self.digests = digests
        self.lora_name = lora_name
        self.cache_salt = cache_salt


class PrefixLinks:
    """Router keys of served requests -> the token blocks each stands for: an LRU of at most `max_keys`
    keys, the most recent link of a key winning. Used from the replica's event loop only (no lock)."""

    def __init__(self, max_keys: int):
        self.max_keys = max(1, max_keys)
        self._links: OrderedDict[bytes, tuple[_Chain, int]] = OrderedDict()  # key -> (chain, blocks needed)

    def __len__(self) -> int:
        return len(self._links)

    def link(self, keys: Sequence[bytes], chars: int, chunk_chars: int, token_ids: Sequence[int],
             block_size: int, lora_name: str | None, cache_salt: str | None = None) -> None:
        """A served request: its prompt was `chars` canonical characters cut into `len(keys)` chunks of
        `chunk_chars`, and the engine saw `token_ids`. Key j stands for the first (j+1)*chunk_chars
        characters, about the same share of the tokens; it is held while the engine holds the whole blocks
        of that share (at least one, at most the prompt's whole blocks)."""
        tokens = len(token_ids)
        full = tokens // block_size if block_size > 0 else 0
        if not keys or chars <= 0 or full == 0:
            for key in keys:  # no block to stand for: an older link of these keys is stale too
                self._links.pop(key, None)
            return
        needs = [min(full, max(1, (j + 1) * chunk_chars * tokens // (chars * block_size)))
                 for j in range(len(keys))]
        deepest = max(needs)
        chain = _Chain(tuple(block_digest(token_ids[i * block_size : (i + 1) * block_size])
                             for i in range(deepest)), lora_name, cache_salt)
        # Last key first, so the head of the prompt is the most recently used: eviction drops tails
        # before heads, as the engine does.
        for key, need in zip(reversed(keys), reversed(needs), strict=True):
            self._links[key] = (chain, need)
            self._links.move_to_end(key)
        while len(self._links) > self.max_keys:
            self._links.popitem(last=False)

    def held_keys(self, index: KVBlockIndex) -> list[bytes]:
        """The linked keys whose blocks `index` holds now, most recently linked first."""
        depths: dict[_Chain, int] = {}
        held = []
        for key, (chain, need) in reversed(self._links.items()):
            depth = depths.get(chain)
            if depth is None:
                depth = depths[chain] = index.held_depth(chain.digests, chain.lora_name, chain.cache_salt)
            if depth >= need:
                held.append(key)
        return held

    def clear(self) -> None:
        self._links.clear()


class KVEventSubscriber:
    """A daemon thread that keeps `index` current from an engine's ZeroMQ event publisher at `endpoint`,
    filling gaps from `replay_endpoint`. After an unrecoverable loss the index is cleared and inexact
    until `resync_after_s` have passed without another loss (or the engine clears its cache): blocks
    stored before the loss and still held stay unknown, and by then the engine's LRU has turned over
    what a busy replica holds; an idle one keeps its old blocks longer, which only under-reports."""

    def __init__(self, endpoint: str, index: KVBlockIndex, replay_endpoint: str | None = None,
                 topic: str = "", resync_after_s: float = 30.0, replay_timeout_s: float = 2.0):
        self.endpoint = endpoint
        self.index = index
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.resync_after_s = resync_after_s
        self.replay_timeout_s = replay_timeout_s
        # Test seam: how many of the next messages the SUB socket delivers are dropped as if lost.
        self._drop_next_for_test = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._decoder: Any = None
        self._last_seq = -1  # the last batch applied; the engine numbers its batches from 0
        self._last_sub_seq = -1  # the last number the SUB socket delivered (it only grows per engine)
        self._lost_at: float | None = None  # monotonic time of the last loss, while the view is inexact
        self._stats_lock = threading.Lock()
        self._counts = dict.fromkeys(("batches", "events", "gaps", "replays", "losses", "duplicates",
                                      "restarts", "undecodable"), 0)
        self._last_lag_s = 0.0
        self._max_lag_s = 0.0

    def start(self) -> None:
        if self._thread is not None:
            return
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close its sockets; safe to call twice, or before `start`."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            out: dict[str, Any] = dict(self._counts)
            out["last_lag_s"] = self._last_lag_s
        out.update(last_seq=self._last_seq, exact=self.index.exact, epoch=self.index.epoch,
                   blocks=self.index.blocks)
        return out

    def take_lag(self) -> float:
        """The largest publish-to-apply lag (seconds) since the last call."""
        with self._stats_lock:
            lag, self._max_lag_s = self._max_lag_s, 0.0
            return lag

    def _count(self, name: str) -> None:
        with self._stats_lock:
            self._counts[name] += 1

    def _run(self) -> None:
        import zmq

        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if sub.poll(int(_POLL_S * 1000)):
                    try:
                        self._on_message(sub.recv_multipart())
                    except Exception:  # one bad message must not end the view: count it as a loss
                        log.exception("KV event from %s could not be applied", self.endpoint)
                        self._lose()
                if self._lost_at is not None and time.monotonic() - self._lost_at >= self.resync_after_s:
                    self._lost_at = None
                    self.index.exact = True
        finally:
            sub.close(linger=0)

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._count("undecodable")
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        if self._drop_next_for_test > 0:
            self._drop_next_for_test -= 1
            self._last_sub_seq = seq
            return
        if seq <= self._last_sub_seq:  # numbers went back: a new engine behind the endpoint, empty
            self._count("restarts")
            self.index.clear()
            self.index.exact, self._lost_at = True, None  # nothing it holds can have been missed yet
            self._last_seq = -1
        self._last_sub_seq = seq
        if seq <= self._last_seq:
            self._count("duplicates")  # a replay brought it already
            return
        if seq > self._last_seq + 1:
            self._count("gaps")
            if self._replay(upto=seq):
                if seq <= self._last_seq:
                    return
            else:
                self._lose()
                self._last_seq = seq - 1  # the view goes on from here
        self._apply(payload, seq, live=True)

    def _apply(self, payload: bytes, seq: int, live: bool) -> None:
        try:
            batch = self._decoder.decode(payload)
        except Exception:
            log.exception("KV event batch %d from %s could not be decoded", seq, self.endpoint)
            self._count("undecodable")
            self._lose()
            self._last_seq = seq
            return
        events = self.index.apply(batch)
        self._last_seq = seq
        lag = time.time() - batch.ts
        with self._stats_lock:
            self._counts["batches"] += 1
            self._counts["events"] += events
            if live:  # a replayed batch is old by design: its age is no lag
                self._last_lag_s = lag
                self._max_lag_s = max(self._max_lag_s, lag)

    def _replay(self, upto: int) -> bool:
        """Fetch and apply the batches after the last one applied, through at least `upto - 1`. False when
        they cannot all be had: no replay socket, the engine's buffer dropped them, or no answer."""
        if self.replay_endpoint is None:
            return False
        import zmq

        self._count("replays")
        start = self._last_seq + 1
        # A fresh socket per replay: a late answer to a replay given up on must not reach the next one.
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
            deadline = time.monotonic() + self.replay_timeout_s
            while not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("no KV event replay from %s within %.1fs", self.replay_endpoint,
                                self.replay_timeout_s)
                    return False
                if not dealer.poll(int(min(left, _POLL_S) * 1000) + 1):
                    continue
                frames = dealer.recv_multipart()
                if len(frames) != 4:
                    return False
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == _END_SEQ:
                    return self._last_seq >= upto - 1
                if seq > self._last_seq + 1:  # the buffer no longer reaches back to what was missed
                    log.warning("KV events %d..%d from %s are lost (replay starts at %d)", self._last_seq + 1,
                                upto - 1, self.endpoint, seq)
                    return False
                if seq == self._last_seq + 1:
                    self._apply(frames[3], seq, live=False)
            return False
        except zmq.ZMQError:
            log.exception("KV event replay from %s failed", self.replay_endpoint)
            return False
        finally:
            dealer.close(linger=0)

    def _lose(self) -> None:
        """Events are gone for good: the view cannot be trusted (inexact first, so no reader sees an
        empty view called exact)."""
        self._count("losses")
        self.index.exact = False
        self.index.clear()
        self._lost_at = time.monotonic()


def engine_kv_events_config(endpoint: str, replay_endpoint: str | None) -> Any:
    """vLLM's KVEventsConfig that makes an engine publish its KV-cache events at `endpoint` (and replay
    recent batches at `replay_endpoint`), topic "kv"."""
    from vllm.config.kv_events import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                          replay_endpoint=replay_endpoint, topic="kv")


def ipc_endpoints(prefix: str) -> tuple[str, str]:
    """Two fresh ipc:// endpoints (events, replay) under the temp dir. Unix socket paths must stay under
    about 100 characters, so the prefix is cut short."""
    stem = os.path.join(tempfile.gettempdir(), f"{prefix[:24]}-{uuid.uuid4().hex[:12]}")
    return f"ipc://{stem}.pub", f"ipc://{stem}.replay"


# ---- the replica's side: its engine's view, its requests' links, its reports ----------------------------

# Set by the replica around one request (a task inherits it): called with the prompt's token ids and the
# LoRA adapter's engine name when the engine answers first, so the request's router keys can be linked.
prompt_observer: ContextVar[Callable[[Sequence[int], str | None], None] | None] = ContextVar(
    "shunter_prompt_observer", default=None)


def observing_prompts(generate: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """AsyncLLM.generate, telling the request's `prompt_observer` (if any) the prompt's token ids with the
    first output. The observer is read when vLLM's handler calls generate, inside the request's task."""

    def observed(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        observer = prompt_observer.get()
        stream = generate(*args, **kwargs)
        if observer is None:
            return stream
        # A request's keys are its first prompt's (a batch of completions is keyed by its first prompt,
        # which vLLM's handler submits first): later prompts of the request are not linked to them.
        prompt_observer.set(None)
        lora = kwargs.get("lora_request")
        return _first_output(stream, observer, getattr(lora, "lora_name", None))

    return observed


async def _first_output(stream: AsyncIterator[Any], observer: Callable[[Sequence[int], str | None], None],
                        lora_name: str | None) -> AsyncIterator[Any]:
    told = False
    try:
        async for output in stream:
            if not told:
                told = True
                tokens = getattr(output, "prompt_token_ids", None)
                if tokens:
                    try:
                        observer(tokens, lora_name)
                    except Exception:  # noqa: BLE001 - routing's bookkeeping never fails a request
                        log.warning("linking a request's prefix keys failed", exc_info=True)
            yield output
    finally:
        # A client that hangs up closes this generator; vLLM aborts the request when its own is closed.
        await stream.aclose()  # type: ignore[attr-defined]


class EnginePrefixView:
    """One replica's precise prefix view: its engine's events kept in an index by a subscriber thread,
    the router keys of the requests it served linked to their token blocks, and the report the routers
    read (`report`, sent with the replica's routing stats). Links are bounded by the engine's blocks:
    a few keys per block."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, block_size: int, kv_blocks: int):
        self.index = KVBlockIndex(block_size)
        self.links = PrefixLinks(max_keys=4 * max(1, kv_blocks))
        self.subscriber = KVEventSubscriber(endpoint, self.index, replay_endpoint)
        self._report_id = uuid.uuid4().hex[:8]
        self._reports = 0
        self._held_keys = 0  # in the last report (the stats and metrics read it; reports come every period)

    def start(self) -> None:
        self.subscriber.start()

    def stop(self) -> None:
        self.subscriber.stop()

    def link(self, keys: Sequence[bytes], chars: int, chunk_chars: int, token_ids: Sequence[int],
             lora_name: str | None, cache_salt: str | None = None) -> None:
        self.links.link(keys, chars, chunk_chars, token_ids, self.index.block_size, lora_name, cache_salt)

    def summary(self) -> dict[str, Any]:
        """For the replica's stats and metrics: the view's counts, its subscriber's, and the keys held at
        the last report (computing them walks every linked chain: once per report is enough)."""
        return {**self.subscriber.stats(), "held_keys": self._held_keys, "linked_keys": len(self.links)}

    def report(self) -> dict[str, Any]:
        """The router keys whose blocks the engine holds now, whether the view is exact, and what the
        prefix metrics show (blocks indexed, keys linked, the events' lag)."""
        self._reports += 1
        keys = self.links.held_keys(self.index)
        self._held_keys = len(keys)
        return {"prefix_keys": keys, "prefix_exact": self.index.exact,
                "prefix_report": f"{self._report_id}-{self._reports}", "prefix_blocks": self.index.blocks,
                "prefix_linked_keys": len(self.links), "prefix_event_lag_s": self.subscriber.take_lag()}
