"""Prefix identity (rendering, chained chunk keys) and the per-replica LRU index of cached prefixes."""

from __future__ import annotations

from shunter.routing.prefix import CHARS_PER_TOKEN, PrefixIndex, PrefixKey, prefix_key, render_prompt

BLOCK = 4  # tokens per KV block in these tests
CHUNK = BLOCK * CHARS_PER_TOKEN  # characters per chunk


def _text(n_chunks: int, fill: str = "a") -> str:
    return fill * (n_chunks * CHUNK)


def _chat(*messages, **extra) -> str:
    return render_prompt("chat", {"messages": [{"role": r, "content": c} for r, c in messages], **extra})


# ---- prefix_key -----------------------------------------------------------------------------------


def test_shared_beginning_shares_exactly_the_common_whole_chunks():
    common = "".join(chr(ord("a") + i) * CHUNK for i in range(5))
    a = prefix_key(common + "x" * (3 * CHUNK), BLOCK)
    b = prefix_key(common + "y" * (3 * CHUNK), BLOCK)
    assert len(a.keys) == len(b.keys) == 8
    assert a.keys[:5] == b.keys[:5]
    assert all(ka != kb for ka, kb in zip(a.keys[5:], b.keys[5:], strict=True))


def test_divergence_inside_a_chunk_breaks_that_chunk_and_all_after():
    common = _text(2) + "z" * (CHUNK // 2)  # two whole chunks, then half of the third in common
    a = prefix_key(common + "1" * (2 * CHUNK), BLOCK)
    b = prefix_key(common + "2" * (2 * CHUNK), BLOCK)
    assert a.keys[:2] == b.keys[:2]
    assert all(ka != kb for ka, kb in zip(a.keys[2:], b.keys[2:], strict=True))


def test_partial_trailing_chunk_gets_no_key():
    assert len(prefix_key(_text(3), BLOCK).keys) == 3
    assert len(prefix_key(_text(3) + "b" * (CHUNK - 1), BLOCK).keys) == 3
    assert prefix_key("a" * (CHUNK - 1), BLOCK).keys == ()
    assert prefix_key("", BLOCK).keys == ()
    # ...and the trailing text does not change the keys of the whole chunks before it
    assert prefix_key(_text(3) + "tail", BLOCK).keys == prefix_key(_text(3), BLOCK).keys


def test_keys_are_chained_so_position_matters():
    a, b = "a" * CHUNK, "b" * CHUNK
    first = prefix_key(a + b, BLOCK).keys  # chunk b at position 1, after a
    second = prefix_key(b + b, BLOCK).keys  # chunk b at position 0, then again at 1 after b
    alone = prefix_key(b, BLOCK).keys
    assert second[0] == alone[0]
    assert first[1] != alone[0] and first[1] != second[1] and second[1] != second[0]


def test_key_counts_characters_and_uncached_tokens():
    key = prefix_key(_text(2) + "abc", BLOCK)
    assert key == PrefixKey(key.keys, 2 * CHUNK + 3, CHUNK)
    assert key.uncached_tokens(0) == (2 * CHUNK + 3) // CHARS_PER_TOKEN
    assert key.uncached_tokens(2) == 3 // CHARS_PER_TOKEN
    assert key.uncached_tokens(99) == 0
    assert prefix_key("", BLOCK).uncached_tokens(0) == 0  # no prompt, nothing to prefill


def test_block_size_sets_the_chunk_length():
    text = _text(8)
    assert len(prefix_key(text, BLOCK).keys) == 8
    assert len(prefix_key(text, 2 * BLOCK).keys) == 4
    assert prefix_key(text, 0).chunk_chars == CHARS_PER_TOKEN  # a block is at least one token


def test_non_ascii_text_is_chunked_by_characters():
    assert len(prefix_key("é" * (2 * CHUNK), BLOCK).keys) == 2
    assert len(prefix_key("\ud800" * CHUNK, BLOCK).keys) == 1  # lone surrogates do not raise


# ---- render_prompt --------------------------------------------------------------------------------


def test_chat_rendering_depends_on_role_order_and_content():
    base = _chat(("system", "be brief"), ("user", "hi"))
    assert base == _chat(("system", "be brief"), ("user", "hi"))
    assert base != _chat(("user", "be brief"), ("user", "hi"))  # role
    assert base != _chat(("user", "hi"), ("system", "be brief"))  # order
    assert base != _chat(("system", "be brief"), ("user", "hello"))  # content
    assert base.startswith(_chat(("system", "be brief")))  # a longer conversation extends the prefix


def test_chat_rendering_puts_tools_first_and_depends_on_them():
    tool = {"type": "function", "function": {"name": "f"}}
    plain = _chat(("user", "hi"))
    with_tools = _chat(("user", "hi"), tools=[tool])
    other_tools = _chat(("user", "hi"), tools=[{"type": "function", "function": {"name": "g"}}])
    assert len({plain, with_tools, other_tools}) == 3
    assert with_tools.endswith(plain)  # tools are rendered before the messages
    # canonical JSON: key order inside a tool does not matter
    reordered = _chat(("user", "hi"), tools=[{"function": {"name": "f"}, "type": "function"}])
    assert reordered == with_tools


def test_chat_rendering_includes_tool_calls_and_text_parts():
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}
    assert render_prompt("chat", {"messages": [call]}) != render_prompt(
        "chat", {"messages": [{"role": "assistant", "content": None}]})
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    assert render_prompt("chat", {"messages": [{"role": "user", "content": parts}]}) == _chat(("user", "hello"))
    image = [{"type": "image_url", "image_url": {"url": "data:1"}}]
    other = [{"type": "image_url", "image_url": {"url": "data:2"}}]
    assert render_prompt("chat", {"messages": [{"role": "user", "content": image}]}) != render_prompt(
        "chat", {"messages": [{"role": "user", "content": other}]})


def test_completion_prompts():
    assert render_prompt("completion", {"prompt": "once upon"}) == "once upon"
    assert render_prompt("completion", {"prompt": ["first", "second"]}) == "first"  # a batch: its first
    ids = render_prompt("completion", {"prompt": [1, 2, 3]})  # token ids: one prompt
    assert ids and ids != render_prompt("completion", {"prompt": [1, 2, 4]})


def test_no_prompt_renders_empty():
    assert render_prompt("embedding", {"input": "x"}) == ""
    assert render_prompt("chat", {}) == ""


# ---- PrefixIndex ----------------------------------------------------------------------------------


def _keys(n: int, fill: str = "a") -> tuple[bytes, ...]:
    return prefix_key(_text(n, fill), BLOCK).keys


def test_matched_counts_leading_chunks_and_stops_at_first_gap():
    index = PrefixIndex()
    keys = _keys(5)
    assert index.matched("r1", keys) == 0
    index.record("r1", keys[:3])
    assert index.matched("r1", keys) == 3
    assert index.matched("r2", keys) == 0
    index.record("r1", keys[4:])  # a later chunk held alone does not count past the gap at 3
    assert index.matched("r1", keys) == 3


def test_capacity_evicts_tails_before_heads():
    index = PrefixIndex()
    keys = _keys(6)
    index.record("r", keys)
    index.set_capacity("r", 4)
    assert index.size("r") == 4
    assert index.matched("r", keys) == 4  # the first four chunks survive


def test_record_over_capacity_keeps_the_head():
    index = PrefixIndex(default_capacity=3)
    keys = _keys(5)
    index.record("r", keys)
    assert index.capacity("r") == 3 and index.size("r") == 3
    assert index.matched("r", keys) == 3


def test_least_recently_used_request_is_evicted_first():
    index = PrefixIndex()
    index.set_capacity("r", 4)
    a, b, c = _keys(2, "a"), _keys(2, "b"), _keys(2, "c")
    index.record("r", a)
    index.record("r", b)
    index.record("r", a)  # a used again: b is now the least recent
    index.record("r", c)
    assert index.matched("r", a) == 2 and index.matched("r", c) == 2
    assert index.matched("r", b) == 0


def test_capacity_is_per_replica_and_at_least_one():
    index = PrefixIndex(default_capacity=10)
    index.set_capacity("r1", 0)
    assert index.capacity("r1") == 1 and index.capacity("r2") == 10
    index.record("r1", _keys(3))
    index.record("r2", _keys(3))
    assert index.size("r1") == 1 and index.size("r2") == 3


def test_retain_and_drop_forget_replicas():
    index = PrefixIndex(default_capacity=10)
    keys = _keys(2)
    for replica in ("r1", "r2", "r3"):
        index.record(replica, keys)
    index.set_capacity("r3", 5)
    index.retain(["r1", "r2"])
    assert index.size("r1") == index.size("r2") == 2 and index.size("r3") == 0
    assert index.matched("r3", keys) == 0 and index.capacity("r3") == 10
    index.drop("r1")
    assert index.size("r1") == 0 and index.size("r2") == 2 and index.matched("r1", keys) == 0
    index.drop("never-seen")  # no error


def test_empty_record_is_a_no_op():
    index = PrefixIndex()
    index.record("r", ())
    assert index.size("r") == 0


def test_the_same_prompt_under_two_adapters_is_two_prefixes():
    body = {"messages": [{"role": "user", "content": "hello " * 40}]}
    a, b = (prefix_key(render_prompt("chat", {**body, "model": name}), 16) for name in ("adapter-a", "adapter-b"))
    assert a.keys and set(a.keys).isdisjoint(b.keys)
    assert render_prompt("chat", {**body, "model": "base"}).startswith("<model>base\n")


# ---- precise: the replica's report of what its engine holds -------------------------------------------


def test_a_report_replaces_belief_and_keys_sent_since_still_count():
    index = PrefixIndex(speculation_s=10)
    a, b = prefix_key("a" * 4000, 16).keys, prefix_key("b" * 4000, 16).keys
    index.record("r1", a, now=0.0)
    assert index.matched("r1", a) == len(a) and not index.is_precise("r1")
    index.record("r1", b, now=15.0)  # sent after a, and after the report's speculation window for a
    index.reported("r1", a[:3], now=20.0)  # the engine evicted all but a's first three blocks
    assert index.is_precise("r1") and index.reported_size("r1") == 3
    assert index.matched("r1", a) == 3, "belief beyond the report is gone"
    assert index.matched("r1", b) == len(b), "b was sent 5 s ago: not in a report yet, still counted"
    index.reported("r1", [], now=30.0)  # b never got cached (or was evicted at once)
    assert index.matched("r1", b) == 0 and index.matched("r1", a) == 0


def test_a_replica_whose_view_is_lost_is_predicted_again_and_a_departed_one_forgotten():
    index = PrefixIndex(speculation_s=10)
    keys = prefix_key("c" * 4000, 16).keys
    index.reported("r1", keys, now=0.0)
    index.unreported("r1")
    assert not index.is_precise("r1") and index.matched("r1", keys) == 0
    index.reported("r2", keys, now=0.0)
    index.retain(["r1"])
    assert not index.is_precise("r2") and index.matched("r2", keys) == 0
