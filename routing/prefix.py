"""Prefix identity of a request, and what each replica is believed to hold in its KV cache.

Identity: the request's prompt is rendered to canonical text (roles, contents, tools: everything that
shapes the tokens the engine will cache, in order) and cut into fixed-size chunks of about one KV block
each (`block_size` tokens x `CHARS_PER_TOKEN`). Each chunk's key hashes the chunk *and its parent's
key*, like vLLM's own block hashes, so a key stands for the whole prefix up to it and two prompts share
keys exactly as far as they share a beginning. Only whole chunks get keys: the engine caches only full
blocks. This approximates the engine's token blocks without tokenizing in the router (no tokenizer to
load or keep in step with the replica's), at the cost of block edges not lining up with token edges.

Memory: `PrefixIndex` keeps per replica an LRU set of keys bounded by that replica's real KV capacity
in blocks (reported by the replica), so belief never outgrows what the engine could hold. In precise
mode the replica also reports which of these keys its engine's blocks really hold (it translates its
engine's KV events into them: `shunter.kv_events`), and that report replaces belief. A routed
request touches its keys from last to first: the first chunks are the most recent, so eviction drops
tails before heads, the order in which vLLM frees a finished request's blocks. Replicas that leave are
dropped whole. Everything is local to the router's process: no remote call on the routing path.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4  # English BPE text averages about four characters per token
DEFAULT_CAPACITY_BLOCKS = 4096  # until a replica reports its real KV capacity
_ROOT = b"shunter-prefix-v1"


@dataclass(frozen=True)
class PrefixKey:
    """A request's chained chunk keys, and how many prompt characters (about tokens) it has in all."""

    keys: tuple[bytes, ...]
    chars: int
    chunk_chars: int

    def uncached_tokens(self, matched_chunks: int) -> int:
        return max(0, self.chars - matched_chunks * self.chunk_chars) // CHARS_PER_TOKEN


def render_prompt(endpoint: str, body: dict[str, Any]) -> str:
    """Canonical text of what the engine will see first, in order; "" when there is no prompt. It starts
    with the `model` the engine is asked for and the request's `cache_salt`: the same prompt under two LoRA
    adapters of one base model, or from two tenants (the gateway salts each key's requests), is two
    prefixes, as the engine's KV blocks are keyed by adapter and salt too."""
    text = _render(endpoint, body)
    if not text:
        return text
    model, salt = body.get("model"), body.get("cache_salt")
    head = f"<model>{model}\n" if isinstance(model, str) else ""
    if isinstance(salt, str) and salt:
        head += f"<salt>{salt}\n"
    return head + text


def _render(endpoint: str, body: dict[str, Any]) -> str:
    if endpoint == "chat":
        parts = []
        for key in ("tools", "chat_template", "chat_template_kwargs"):  # rendered before the messages
            if body.get(key) is not None:
                parts.append(f"<{key}>{_canonical(body[key])}")
        for message in body.get("messages") or []:
            if isinstance(message, dict):
                parts.append(f"<{message.get('role')}>{_content_text(message.get('content'))}")
                for key in ("name", "tool_calls", "tool_call_id"):
                    if message.get(key) is not None:
                        parts.append(f"<{key}>{_canonical(message[key])}")
            else:
                parts.append(_canonical(message))
        return "\n".join(parts)
    if endpoint == "responses":  # instructions and tools first, then the input items, as the template renders
        parts = [f"<{key}>{_canonical(body[key])}" for key in ("tools", "instructions") if body.get(key) is not None]
        items = body.get("input")
        for item in [{"role": "user", "content": items}] if isinstance(items, str) else items or []:
            parts.append(_message_text(item))
        return "\n".join(parts)
    if endpoint == "messages":
        parts = [f"<{key}>{_canonical(body[key])}" for key in ("tools", "system") if body.get(key) is not None]
        parts += [_message_text(message) for message in body.get("messages") or []]
        return "\n".join(parts)
    if endpoint == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: its first prompt stands for the request
        if prompt is None:
            return ""
        return prompt if isinstance(prompt, str) else _canonical(prompt)
    return ""


def _message_text(message: Any) -> str:
    """One message or input item: its role and content text, or its canonical JSON (a tool call, ...)."""
    if isinstance(message, dict) and "role" in message and "content" in message:
        return f"<{message.get('role')}>{_content_text(message.get('content'))}"
    return _canonical(message)


def prefix_key(text: str, block_size: int) -> PrefixKey:
    """Chained keys of the whole chunks of `text`, one chunk per KV block of `block_size` tokens."""
    chunk = max(1, block_size) * CHARS_PER_TOKEN
    keys, parent = [], _ROOT
    # Chunk by characters (not bytes) so non-ASCII text keeps about a block per chunk.
    for start in range(0, len(text) - chunk + 1, chunk):
        piece = text[start : start + chunk].encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(parent + piece, digest_size=12).digest()
        keys.append(parent)
    return PrefixKey(tuple(keys), len(text), chunk)


class PrefixIndex:
    """Per replica: the prefix keys it is believed to hold.

    Approximate (no report from the replica): an LRU of the keys sent there, bounded by its KV capacity.
    Precise (`reported`): the replica's own report of the keys its engine's blocks really hold (from the
    engine's KV events, `shunter.kv_events`), and on top of it the keys sent there since, for
    `speculation_s`: a request's blocks reach a report only after its prefill and the next stats poll, and
    until then the router counts them as if they had. An eviction, a restart or another gateway's traffic
    shows at the next report; nothing older than a report is believed beyond it."""

    def __init__(self, default_capacity: int = DEFAULT_CAPACITY_BLOCKS, speculation_s: float = 10.0):
        self.default_capacity = default_capacity
        self.speculation_s = speculation_s
        self._held: dict[str, OrderedDict[bytes, float]] = {}  # key -> when it was last sent there
        self._capacity: dict[str, int] = {}
        self._reported: dict[str, frozenset[bytes]] = {}  # precise replicas: what their engines hold

    def reported(self, replica: str, keys: Iterable[bytes], now: float) -> None:
        """The replica's report of the keys its engine holds: the truth from now on, with what was sent
        there within `speculation_s` (not in a report yet) on top."""
        self._reported[replica] = frozenset(keys)
        held = self._held.get(replica)
        cutoff = now - self.speculation_s
        while held and next(iter(held.values())) < cutoff:  # oldest first: record() moves keys to the end
            held.popitem(last=False)

    def unreported(self, replica: str) -> None:
        """The replica's view is not exact any more (events lost, engine restarted): back to predicting."""
        self._reported.pop(replica, None)

    def is_precise(self, replica: str) -> bool:
        return replica in self._reported

    def reported_size(self, replica: str) -> int:
        return len(self._reported.get(replica, ()))

    def set_capacity(self, replica: str, blocks: int) -> None:
        self._capacity[replica] = max(1, int(blocks))
        self._evict(replica)

    def capacity(self, replica: str) -> int:
        return self._capacity.get(replica, self.default_capacity)

    def matched(self, replica: str, keys: Iterable[bytes]) -> int:
        """How many leading chunks of a request the replica holds (stops at the first gap)."""
        held = self._held.get(replica) or {}
        truth = self._reported.get(replica, frozenset())
        count = 0
        for key in keys:
            if key not in held and key not in truth:
                break
            count += 1
        return count

    def record(self, replica: str, keys: tuple[bytes, ...], now: float = 0.0) -> None:
        """The request went to `replica`: it will hold these chunks (heads most recently used)."""
        if not keys:
            return
        held = self._held.setdefault(replica, OrderedDict())
        for key in reversed(keys):
            held[key] = now
            held.move_to_end(key)
        self._evict(replica)

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget every replica not in `replicas` (they left the deployment)."""
        keep = set(replicas)
        for replica in [r for r in self._held if r not in keep]:
            self.drop(replica)
        for replica in [r for r in self._capacity if r not in keep]:
            del self._capacity[replica]
        for replica in [r for r in self._reported if r not in keep]:
            del self._reported[replica]

    def drop(self, replica: str) -> None:
        self._held.pop(replica, None)
        self._capacity.pop(replica, None)
        self._reported.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self._held.get(replica, ()))

    def _evict(self, replica: str) -> None:
        held = self._held.get(replica)
        if held is None:
            return
        limit = self.capacity(replica)
        while len(held) > limit:
            held.popitem(last=False)


def _content_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:  # images, audio, files: their identity is their canonical JSON
                out.append(_canonical(part))
        return "".join(out)
    return _canonical(content)


def _canonical(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(value)
