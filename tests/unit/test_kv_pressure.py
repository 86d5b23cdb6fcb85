"""The kv-pressure workload (seeded, Zipf-skewed groups, growing multi-turn history, sized past a replica's
KV cache) and the oracle that gives the hit rate's ceiling (LRU of whole blocks, chained prefix hits, the
balance bound), on a fake tokenizer: no Ray, no engine."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest

from shunter.bench.kv_oracle import (
    BlockKeys,
    LRUBlockCache,
    PromptRecorder,
    default_max_load_gap,
    oracle_for_run,
    prompt_token_ids,
    simulate,
)
from shunter.bench.loadgen import LoadConfig, run_load
from shunter.bench.runner import build_sessions, load_tokenizer, run_parser
from shunter.bench.workloads import LengthDist, TextMaker, describe, kv_pressure_sizing, kv_pressure_workload

MINILM = "builtin:all-minilm-l6-v2"  # a real tokenizer that needs no preparation


@pytest.fixture(scope="module")
def maker() -> TextMaker:
    return TextMaker(load_tokenizer(MINILM))


def _workload(maker, seed=0, **kw):
    args = {"groups": 8, "sessions": 30, "turns": 3, "system_len": 64, "turn_len": LengthDist.parse("uniform:8:16"),
            "output_len": LengthDist.parse("fixed:4"), "zipf_s": 1.1, **kw}
    return kv_pressure_workload(maker, seed=seed, **args)


def test_kv_pressure_is_seeded_and_deterministic(maker):
    def shape(sessions):
        return [(s.group, s.system, [(t.text, t.max_tokens) for t in s.turns]) for s in sessions]

    assert shape(_workload(maker, seed=4)) == shape(_workload(maker, seed=4))
    assert shape(_workload(maker, seed=4)) != shape(_workload(maker, seed=5))


def test_kv_pressure_groups_are_zipf_skewed_and_interleaved(maker):
    sessions = _workload(maker, sessions=200, turns=1, system_len=16)
    assert [s.index for s in sessions] == list(range(200))
    counts = Counter(s.group for s in sessions)
    assert counts[0] > counts[1] > counts[7] > 0, counts  # the first group is the most popular
    systems = {}
    for s in sessions:
        systems.setdefault(s.group, set()).add(s.system)
    assert all(len(v) == 1 for v in systems.values()) and len({next(iter(v)) for v in systems.values()}) == 8
    groups = [s.group for s in sessions]
    assert groups != sorted(groups)  # sessions of one group do not come in a block
    assert describe(sessions)["groups"] == 8
    with pytest.raises(ValueError):
        _workload(maker, groups=0)


def test_kv_pressure_sizing_counts_each_system_prompt_once_and_every_history(maker):
    sessions = _workload(maker)
    sizing = kv_pressure_sizing(sessions)
    used = {s.group: s.meta["system_tokens"] for s in sessions}
    assert all(62 <= n <= 64 for n in used.values())
    history = sum(sum(t.prompt_tokens for t in s.turns) + 4 * (len(s.turns) - 1) for s in sessions)
    assert sizing["groups_used"] == len(used) and sizing["system_prefix_tokens"] == sum(used.values())
    assert sizing["session_history_tokens"] == history
    assert sizing["distinct_prefix_tokens"] == sum(used.values()) + history


def test_the_bench_configuration_outgrows_a_replicas_kv_cache_twice():
    """`shunter bench routing --workload kv-pressure` as configured: distinct prompt tokens >= 2x one
    replica's usable KV blocks, and its longest request within max_model_len. (Measured with MiniLM's
    tokenizer: the text is made to exact token counts of whichever tokenizer, and the seeded draws do not
    depend on it.)"""
    from shunter.cli.bench_routing import (
        KV_PRESSURE_BLOCKS,
        KV_PRESSURE_MAX_MODEL_LEN,
        KV_PRESSURE_WORKLOAD,
        kv_pressure_engine,
        longest_request_tokens,
    )

    args = run_parser().parse_args([*KV_PRESSURE_WORKLOAD, "--tokenizer", MINILM])
    sessions, workload = build_sessions(args)
    capacity = (KV_PRESSURE_BLOCKS - 1) * 128
    assert workload["distinct_prefix_tokens"] >= 2 * capacity, (workload["distinct_prefix_tokens"], capacity)
    assert workload["kind"] == "kv-pressure" and workload["requests"] == 64 * 2
    assert workload["longest_session_tokens"] + 8 * (1 + 2 * args.turns) <= longest_request_tokens(KV_PRESSURE_WORKLOAD)
    assert longest_request_tokens(KV_PRESSURE_WORKLOAD) <= KV_PRESSURE_MAX_MODEL_LEN
    engine = kv_pressure_engine({"max_model_len": 4096, "extra_engine_args": {"x": 1}})
    assert engine == {"max_model_len": KV_PRESSURE_MAX_MODEL_LEN,
                      "extra_engine_args": {"x": 1, "num_gpu_blocks_override": KV_PRESSURE_BLOCKS}}
    with pytest.raises(ValueError):
        kv_pressure_engine({}, blocks=8)


def _sse(answer: str) -> bytes:
    chunks = [{"choices": [{"delta": {"content": answer}}]},
              {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 4}}]
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def test_each_turn_resends_the_growing_conversation_with_the_servers_answers(maker, monkeypatch):
    sessions = _workload(maker, sessions=6, turns=3, system_len=16)
    received = []

    async def handler(request: httpx.Request) -> httpx.Response:
        received.append(json.loads(request.content))
        answer = f"answer-{len(received) - 1}"  # the k-th request's answer names k
        await asyncio.sleep(0.005)  # a server takes time: sessions in flight interleave
        return httpx.Response(200, content=_sse(answer), headers={"content-type": "text/event-stream"})

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    recorder = PromptRecorder()
    cfg = LoadConfig(base_url="http://bench/v1", model="m", concurrency=3, max_requests=18, progress=False,
                     on_send=recorder)
    records, _ = asyncio.run(run_load(sessions, cfg))
    bodies = recorder.in_order()
    assert len(bodies) == len(records) == 18 and all(r.ok for r in records)
    assert bodies == received, "the k-th body recorded is the k-th request sent"
    by_first = {s.turns[0].text: s for s in sessions}
    for k, body in enumerate(bodies):
        msgs = body["messages"]
        session = by_first[msgs[1]["content"]]
        assert msgs[0] == {"role": "system", "content": session.system}
        turns = len(msgs) // 2
        assert [m["content"] for m in msgs[1::2]] == [t.text for t in session.turns[:turns]]
        if turns > 1:  # the previous turn's prompt, whole, then the answer the server gave it, then more
            answer = msgs[-2]
            j = int(answer["content"].removeprefix("answer-"))
            assert answer["role"] == "assistant" and j < k and bodies[j]["messages"] == msgs[:-2]
    lengths = Counter(len(b["messages"]) for b in bodies)
    assert lengths[6] >= 4, lengths  # sessions reach their third turn, the history grown twice
    assert len({b["messages"][1]["content"] for b in bodies[:3]}) == 3  # three sessions in flight at once



@pytest.mark.parametrize("load", [{"concurrency": 3}, {"concurrency": None, "rate": 200.0}])
def test_one_pass_sends_each_session_once_and_every_turn_of_it(maker, monkeypatch, load):
    """A run that is one pass over the workload (the bench's runs) never starts a session over: a worker
    or an arrival that finds budget left while other sessions' later turns are still to come used to
    replay a finished session, whose prompts every engine already cached, and cut another one short."""
    sessions = _workload(maker, sessions=7, turns=3, system_len=16)

    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.002 * (len(request.content) % 5))  # unequal service times: sessions finish out of order
        return httpx.Response(200, content=_sse("ok"), headers={"content-type": "text/event-stream"})

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    recorder = PromptRecorder()
    cfg = LoadConfig(base_url="http://bench/v1", model="m", max_requests=21, progress=False, on_send=recorder,
                     one_pass=True, **load)
    records, _ = asyncio.run(run_load(sessions, cfg))
    assert len(records) == 21 and all(r.ok for r in records)
    firsts = Counter(b["messages"][1]["content"] for b in recorder.in_order())
    assert sorted(firsts.values()) == [3] * 7 and set(firsts) == {s.turns[0].text for s in sessions}



def test_fan_out_makes_runs_of_sessions_of_one_group_each_with_its_own_messages(maker):
    sessions = _workload(maker, sessions=12, turns=2, fan_out=4)
    runs = [sessions[i:i + 4] for i in range(0, 12, 4)]
    assert all(len({s.group for s in run}) == 1 for run in runs)
    assert len({s.turns[0].text for s in sessions}) == 12
    with pytest.raises(ValueError):
        _workload(maker, fan_out=0)
    with pytest.raises(ValueError, match="burst"):
        LoadConfig(base_url="x", model="m", concurrency=4, burst=2, max_requests=4)


def test_a_burst_starts_its_sessions_together(maker, monkeypatch):
    """--burst 3: each Poisson arrival starts three sessions of one group at once (the sessions/s rate
    unchanged, so arrivals come at a third of it); they are all sent before any of them is answered."""
    sessions = _workload(maker, sessions=6, turns=2, system_len=16, fan_out=3)
    events = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        events.append(("sent", body["messages"][1]["content"], len(body["messages"])))
        await asyncio.sleep(0.05)
        events.append(("answered",))
        return httpx.Response(200, content=_sse("ok"), headers={"content-type": "text/event-stream"})

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    cfg = LoadConfig(base_url="http://bench/v1", model="m", concurrency=None, rate=6.0, burst=3, max_requests=12,
                     progress=False, one_pass=True, seed=0)  # arrivals ~0.9 s apart, answers in 0.05 s
    records, _ = asyncio.run(run_load(sessions, cfg))
    assert len(records) == 12 and all(r.ok for r in records)
    first = {s.turns[0].text: s for s in sessions}
    assert [e[0] for e in events[:4]] == ["sent"] * 3 + ["answered"]
    burst = [first[e[1]] for e in events[:3]]
    assert {s.index for s in burst} == {0, 1, 2} and len({s.group for s in burst}) == 1
    assert all(e[2] == 2 for e in events[:3])  # first turns: the system prompt and a user message



def test_a_policys_run_options_replace_the_workloads_arrivals():
    """`shunter bench routing --rate/--concurrency/--burst/--scale-out` as the load generator reads them."""
    from shunter.cli.bench_routing import KV_PRESSURE_WORKLOAD, SCALE_OUT_LOAD, run_options

    def parsed(options):
        return run_parser().parse_args([*options, "--tokenizer", MINILM])

    steady = parsed(run_options("kv-pressure"))
    assert (steady.rate, steady.concurrency, steady.burst, steady.conversations) == (1.0, None, 1, 64)
    assert run_options("kv-pressure") == KV_PRESSURE_WORKLOAD
    closed = parsed(run_options("kv-pressure", concurrency=4))
    assert (closed.rate, closed.concurrency) == (None, 4)
    bursty = parsed(run_options("kv-pressure", rate=0.5, burst=4))
    assert (bursty.rate, bursty.burst) == (0.5, 4)
    scaling = parsed(run_options("kv-pressure", scale_out=True))
    assert (scaling.rate, scaling.conversations) == (SCALE_OUT_LOAD["rate"], SCALE_OUT_LOAD["conversations"])
    assert parsed(run_options("kv-pressure", rate=2.0, scale_out=True)).rate == 2.0


class FakeTokenizer:
    """Words as tokens; a chat renders as `<role> content` pieces plus the generation prompt."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text, add_special_tokens=True):
        ids = [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]
        return ([-1] if add_special_tokens else []) + ids

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert not tokenize
        text = " ".join(f"<{m['role']}> {m['content']}" for m in messages)
        return text + (" <assistant>" if add_generation_prompt else "")


def test_block_keys_are_chained_and_cover_full_blocks_only():
    keys = BlockKeys(block_size=2)
    a = keys([1, 2, 3, 4, 5])  # the lone 5 is a partial block: not cached
    assert len(a) == 2 and keys([1, 2, 3, 4]) == a
    assert keys([9, 9, 3, 4])[1] != a[1], "the same tokens after another prefix are another block"
    assert keys([1, 2, 7, 7])[0] == a[0] and len(keys) == 5
    assert keys([1]) == []


def test_lru_evicts_the_least_recently_used_and_a_requests_tail_first():
    cache = LRUBlockCache(2)
    cache.admit([1])
    cache.admit([2])
    cache.admit([1])  # 1 used again: 2 is now the oldest
    cache.admit([3])
    assert 1 in cache and 3 in cache and 2 not in cache and len(cache) == 2
    cache = LRUBlockCache(3)
    cache.admit([10, 11, 12])
    cache.admit([20])
    assert cache.leading_hits([10, 11, 12]) == 2 and 12 not in cache  # the tail went first
    cache = LRUBlockCache(2)
    cache.admit([1, 2, 3])  # a prompt longer than the cache keeps its head
    assert cache.leading_hits([1, 2, 3]) == 2
    with pytest.raises(ValueError):
        LRUBlockCache(0)


def test_a_hit_is_the_leading_chain_of_full_blocks_and_never_the_last_token():
    cache = LRUBlockCache(8)
    cache.admit([1, 2, 3])
    assert cache.leading_hits([1, 2, 3]) == 3 and cache.leading_hits([1, 9, 3]) == 1
    assert cache.leading_hits([9, 2, 3]) == 0  # a chain: nothing after the first miss counts
    bs = 4
    one = list(range(8))  # exactly two blocks
    result = simulate([one, one, one + [99]], replicas=1, capacity_blocks=8, block_size=bs, max_load_gap=8)
    # the repeat hits 1 block (vLLM computes the last token, so not the second block); the longer one both
    assert result.hit_tokens == 0 + 4 + 8 and result.prompt_tokens == 8 + 8 + 9
    assert result.hit_rate == pytest.approx(12 / 25) and result.distinct_blocks == 2


def test_the_oracle_routes_to_the_most_cached_replica_within_the_load_gap():
    bs = 2
    hot = [1, 2, 3, 4, 5]
    result = simulate([hot] * 5, replicas=2, capacity_blocks=8, block_size=bs, max_load_gap=1)
    # 1st: a tie, to replica 0; 2nd: 0 holds it and is 1 ahead (allowed); 3rd: 0 is 2 ahead, so 1 (a miss)
    assert result.choices == [0, 0, 1, 1, 0]
    assert result.hit_tokens == 3 * 2 * bs and result.requests_per_replica == [3, 2]
    cold = [[10 * i + j for j in range(4)] for i in range(4)]  # nothing shared: ties go to the less used
    assert simulate(cold, replicas=2, capacity_blocks=8, block_size=bs, max_load_gap=8).choices == [0, 1, 0, 1]
    sticky = simulate([hot] * 5, replicas=2, capacity_blocks=8, block_size=bs)
    assert sticky.max_load_gap == default_max_load_gap() == 8 and sticky.choices == [0] * 5


def test_the_oracle_feels_the_pressure_of_a_small_cache():
    bs = 2
    prompts = [[g * 100 + j for j in range(6)] for g in range(4)] * 3  # 4 prefixes of 3 blocks, cycled
    roomy = simulate(prompts, replicas=1, capacity_blocks=12, block_size=bs)
    tight = simulate(prompts, replicas=1, capacity_blocks=6, block_size=bs)  # LRU thrashes
    two = simulate(prompts, replicas=2, capacity_blocks=6, block_size=bs, max_load_gap=0)  # each holds half
    assert roomy.hit_rate > 0 and tight.hit_rate == 0 and two.hit_rate == roomy.hit_rate
    assert tight.distinct_over_capacity == 2.0


def test_prompt_token_ids_render_chats_through_the_template():
    tok = FakeTokenizer()
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]}
    (ids,) = prompt_token_ids([chat], tok)
    assert len(ids) == len("<system> be brief <user> hi there <assistant>".split())
    assert prompt_token_ids([{"prompt": "a b"}], tok) == [[-1, tok.vocab["a"], tok.vocab["b"]]]
    with pytest.raises(ValueError):
        prompt_token_ids([{"input": []}], tok)


def test_oracle_for_run_skips_refused_requests_and_checks_token_counts():
    tok = FakeTokenizer()
    system = " ".join(f"s{i}" for i in range(16))
    bodies = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]}
              for i in range(4)]
    size = len(prompt_token_ids(bodies[:1], tok)[0])  # 20 tokens: 5 blocks of 4
    records = [{"index": 0, "status": 200, "ok": True, "prompt_tokens": size},
               {"index": 1, "status": 429, "ok": False, "prompt_tokens": 0},
               {"index": 2, "status": 200, "ok": True, "prompt_tokens": size + 1},
               {"index": 3, "status": 200, "ok": False, "prompt_tokens": 0}]  # cut mid-stream, still prefilled
    out = oracle_for_run(bodies, list(reversed(records)), tok, replicas=2, kv_cache_blocks=5, block_size=4)
    assert out["requests"] == 3 and out["capacity_blocks"] == 4  # one block is vLLM's null block
    assert out["hit_tokens"] == 2 * 16 and out["hit_rate"] == pytest.approx(32 / (3 * size))
    assert out["token_count_checked"] == 2 and out["token_count_mismatches"] == 1
    assert out["token_count_max_diff"] == 1 and "choices" not in out
    with pytest.raises(ValueError, match="bodies"):
        oracle_for_run(bodies[:2], records, tok, replicas=2, kv_cache_blocks=5, block_size=4)


def _row(policy, ttft_p50, hit_rate, oracle=0.8):
    summary = {"ttft_s": {"p50": ttft_p50, "p90": 2 * ttft_p50}, "e2e_s": {"p50": 3 * ttft_p50},
               "output_tokens_per_s": 50.0, "goodput": {"fraction": 0.9}, "failed": 0}
    return {"policy": policy, "summary": summary, "kv_cache": {"blocks": 92, "block_size": 128},
            "workload": {"distinct_prefix_tokens": 40972},
            "engine_prefix_cache": {"hit_rate": hit_rate, "prompt_tokens_share_per_replica": [0.45, 0.55]},
            "oracle": {"hit_rate": oracle, "distinct_blocks": 312, "distinct_over_capacity": 312 / 91}}


def test_the_comparison_reports_the_goals_as_ratios_of_one_run():
    from shunter.cli.bench_routing_report import goals, kv_pressure_section, routing_section

    rows = [_row("precise", 0.2, 0.76), _row("approximate", 0.3, 0.7), _row("least_connections", 0.7, 0.6),
            _row("power_of_two", 0.8, 0.55), _row("ray_prefix_cache_affinity", 0.25, 0.72)]
    result = {"workload": "kv-pressure", "replicas": 2, "model": "m", "workload_options": ["--seed", "0"],
              "engine": {"max_model_len": 2048, "extra_engine_args": {"num_gpu_blocks_override": 92}}, "rows": rows}
    got = {g["goal"]: (round(g["value"], 3), g["met"]) for g in goals(result)}
    assert got == {"TTFT p50: power_of_two / precise": (4.0, True),
                   "TTFT p50: ray_prefix_cache_affinity / precise": (1.25, False),
                   "engine hit rate: precise / its oracle": (0.95, True)}
    text = kv_pressure_section(result)
    assert text.startswith("## 7. ") and "3.5x" in text and "91 usable blocks of 128 = 11,648 tokens" in text
    assert "| precise | 200 ms | 400 ms |" in text and "| 76.0% | 80.0% | 0.95 |" in text
    shared = {**result, "workload": "shared-prefix"}
    assert [g["met"] for g in goals(shared)] == [True, True, True]  # precise no worse than approximate
    assert routing_section(shared).startswith("## 4. ") and "approximate 1.5x" in routing_section(shared)
    assert goals({**result, "rows": rows[1:]})[0]["met"] is None  # precise not run: nothing to judge
    assert "8 sessions in flight at once (a closed loop)" in text

    from shunter.cli.bench_routing import SCALE_OUT_AUTOSCALING, run_options

    scaled = {**result, "workload_options": run_options("kv-pressure", scale_out=True),
              "scale_out": {"autoscaling": SCALE_OUT_AUTOSCALING}}
    text = kv_pressure_section(scaled, 8)
    assert text.startswith("## 8. Scaling out under KV-cache pressure, 1 to 2 replicas")
    assert "--scale-out" in text and '"max_replicas": 2' in text
    assert "sessions starting at Poisson times, 0.9 a second, whatever the servers' pace" in text


def test_a_scale_out_run_reports_the_requests_sent_once_the_added_replica_was_up():
    from shunter.cli.bench_routing import after_scale_out
    from shunter.cli.bench_routing_report import scale_out_table

    def req(start, ttft, replica, ok=True):
        return {"start_s": start, "ttft_s": ttft if ok else None, "ok": ok, "replica": replica}

    requests = [req(1, 9.0, "a"), req(5, 12.0, "a"), req(31, 0.4, "a"), req(32, 0.2, "b"), req(40, 0.3, "b"),
                req(41, 0.5, None), req(42, None, "b", ok=False)]
    after = after_scale_out(requests, 30.0)
    assert after["requests"] == 4 and after["shares"] == [0.25, 0.25, 0.5]  # a, unknown, b
    assert after["ttft_p50_s"] == pytest.approx(0.35) and after["second_replica_at_s"] == 30.0
    assert after_scale_out(requests, None) == {"second_replica_at_s": None}
    table = scale_out_table([{"policy": "precise", "after_scale_out": after},
                             {"policy": "ray_prefix_cache_affinity", "after_scale_out": {"second_replica_at_s": None}}])
    assert "| precise | 30 s | 4 | 350 ms |" in table and "| ray_prefix_cache_affinity | never |" in table


def test_what_isolation_costs_is_reported_per_policy_from_one_run():
    from shunter.cli.bench_routing_report import isolation_section

    rows = [{**_row("precise per-key", 0.6, 0.5), "tenants": {"keys": 4, "cache_group": None}},
            {**_row("precise one-group", 0.2, 0.8), "tenants": {"keys": 4, "cache_group": "org"}}]
    text = isolation_section({"replicas": 2, "model": "m", "workload_options": ["--seed", "0"], "rows": rows})
    assert text.startswith("## 9. ") and "--tenants 4" in text
    assert "precise: TTFT p50 3.00x, hit rate 50.0% against 80.0%" in text


def test_each_session_of_a_tenant_run_sends_its_users_key():
    from shunter.bench.loadgen import LoadConfig, _tenant
    from shunter.bench.workloads import Session

    cfg = LoadConfig(base_url="http://x/v1", model="m", max_requests=1, tenant_keys=("k0", "k1"))
    assert _tenant(cfg, Session(7, [], meta={"user": 3})) == {"Authorization": "Bearer k1"}
    assert _tenant(cfg, Session(4, [])) == {"Authorization": "Bearer k0"}, "no user: by its index"
    assert _tenant(LoadConfig(base_url="http://x/v1", model="m", max_requests=1), Session(1, [])) is None
