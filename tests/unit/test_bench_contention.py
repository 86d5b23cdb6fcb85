"""`shunter bench contention` without engines: each workload's schedule, the share / goodput / ratio
arithmetic, the report's goal lines, the flags, and the client against a fake server (httpx's mock
transport): what it counts from a stream, how it retries after Retry-After."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from shunter.cli import bench_contention as bc
from shunter.cli import bench_contention_report as rep

ROOT = Path(__file__).resolve().parents[2]


# ---- schedules ----

def test_light_tenant_sends_every_interval_inside_its_phase():
    assert bc.light_schedule(0.0, 30.0, 2.0) == [2.0 * i for i in range(15)]
    under = bc.light_schedule(10.0, 90.0, 2.0)
    assert len(under) == 40 and under[0] == 10.0 and under[-1] == 88.0
    assert bc.light_schedule(5.0, 5.0, 2.0) == []
    with pytest.raises(ValueError):
        bc.light_schedule(0.0, 10.0, 0.0)


def test_same_class_tenants_start_interleaved_in_proportion():
    order = bc.share_order(bc.Workload().share_streams)
    assert order.count("tenant-a") == 132 and order.count("tenant-b") == 44
    for i in range(0, len(order), 4):  # every run of four: three of a, one of b; neither starts first
        assert order[i:i + 4].count("tenant-b") == 1
    assert bc.share_order((3, 1)) == ["tenant-a", "tenant-a", "tenant-a", "tenant-b"]
    assert bc.share_order((1, 1)) == ["tenant-a", "tenant-b"]
    assert bc.share_order((0, 2)) == ["tenant-b", "tenant-b"]


def test_closed_loop_streams_start_spread_over_the_ramp():
    assert bc.ramp(4, 2.0) == [0.0, 0.5, 1.0, 1.5]
    assert bc.ramp(3, 0.0) == [0.0, 0.0, 0.0]


def test_goodput_arrivals_are_seeded_poisson_at_twice_capacity():
    w = bc.Workload()
    assert bc.mean_goodput_tokens(w) == pytest.approx(0.5 * 16 + 0.5 * 128)
    rate = bc.goodput_rate(90.0, w)
    assert rate == pytest.approx(2 * 90.0 / 72)
    with pytest.raises(ValueError):
        bc.goodput_rate(0.0, w)
    arrivals = bc.goodput_schedule(rate, 600.0, 0.5, seed=3)
    assert arrivals == bc.goodput_schedule(rate, 600.0, 0.5, seed=3) != bc.goodput_schedule(rate, 600.0, 0.5, seed=4)
    times = [t for t, _ in arrivals]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 600.0
    assert abs(len(arrivals) / 600.0 - rate) < 0.15 * rate
    interactive = sum(1 for _, k in arrivals if k == "interactive") / len(arrivals)
    assert 0.45 < interactive < 0.55 and {k for _, k in arrivals} == {"interactive", "batch"}


def test_quick_cuts_every_phase_to_a_quarter_but_the_light_interval():
    d = bc.Durations().scaled(0.25)
    assert d.flood_s == 22.5 and d.light_alone_s == 7.5 and d.goodput_s == 15.0 and d.settle_s == 2.5
    assert d.light_interval_s == 2.0


# ---- flags ----

def test_flags_pick_sides_durations_and_workload():
    args, sides, d, w = bc.options([])
    assert sides == list(bc.DEFAULT_SIDES) and d == bc.Durations() and w == bc.Workload()
    assert args.out == Path("results/contention.json") and not args.quick
    _, sides, d, _ = bc.options(["--quick", "--no-ray-serve-llm", "--with-classes-fcfs"])
    assert "ray-serve-llm" not in sides and sides[-1] == "shunter-classes-fcfs"
    assert d == bc.Durations().scaled(0.25)
    _, sides, d, w = bc.options(["--sides", "vllm-fcfs,shunter-classes", "--quick", "--flood", "40",
                                 "--share-streams", "60:20", "--share-weights", "3:1", "--target-interactive", "1"])
    assert sides == ["vllm-fcfs", "shunter-classes"] and d.flood_s == 40.0 and d.flood_alone_s == 45.0 / 4
    assert w.share_streams == (60, 20) and w.share_weights == (3.0, 1.0) and w.target_interactive_s == 1.0
    for bad in (["--sides", "vllm,shunter"], ["--share-streams", "3"], ["--share-weights", "1:0"],
                ["--settle", "50"]):
        with pytest.raises(SystemExit):
            bc.options(bad)


def test_the_command_is_registered():
    from shunter.cli import BENCHMARKS, main

    assert "contention" in BENCHMARKS
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "contention", "--help"])
    assert exit_.value.code == 0


# ---- sides ----

def test_only_vllm_with_priority_scheduling_gets_a_priority_field():
    for name, side in bc.SIDES.items():
        client = bc.Client("http://x", "m", side)
        try:
            body = client.body(bc.Shot("light", "interactive", 0.0), 16, "hi")
            flood = client.body(bc.Shot("flood", "batch", 0.0), 128, "hi")
        finally:
            asyncio.run(client.close())
        assert body["ignore_eos"] and body["stream"] and body["stream_options"]["continuous_usage_stats"]
        if name == "vllm-priority":
            assert body["priority"] < flood["priority"]  # lower goes first
        else:
            assert "priority" not in body and "priority" not in flood


def test_shunter_sides_configs(tmp_path):
    from shunter.cli.app_files import load_app_configs

    (_, cfg), *_ = load_app_configs(ROOT / "configs/local.yaml")
    model = cfg.find_model("smollm2-135m-instruct")
    w = bc.Workload(share_weights=(3.0, 1.0))
    plain = bc.shunter_config(cfg, model, bc.SIDES["shunter-no-classes"], tmp_path, w)
    assert [m.name for m in plain.models] == [model.name] and plain.models[0].replicas == 1
    assert plain.models[0].engine.scheduling_policy == "fcfs"
    assert {k.priority_class for k in plain.auth.keys} == {"standard"}
    assert plain.flow_control.default_classes
    classes = bc.shunter_config(cfg, model, bc.SIDES["shunter-classes"], tmp_path, w)
    assert classes.models[0].engine.scheduling_policy == "priority"
    keys = {k.name: k for k in classes.auth.keys}
    assert keys["light"].priority_class == "interactive" and keys["flood"].priority_class == "batch"
    assert keys["tenant-a"].weight == 3.0 and keys["tenant-b"].weight == 1.0
    assert keys["light"].key_file == str(tmp_path / "tenant-0")
    flow = classes.flow_control
    assert flow.find("interactive").max_wait_s == w.target_interactive_s
    assert flow.find("batch").max_wait_s == w.target_batch_s
    kept = bc.shunter_config(cfg, model, bc.SIDES["shunter-classes"], tmp_path, w, deadlines_from_targets=False)
    assert kept.flow_control.default_classes
    assert bc.shunter_config(cfg, model, bc.SIDES["shunter-classes-fcfs"], tmp_path, w).models[0].engine \
        .scheduling_policy == "fcfs"
    for deadlines in (True, False):
        more = bc.shunter_config(cfg, model, bc.SIDES["shunter-classes-share75"], tmp_path, w, deadlines).flow_control
        assert more.find("batch").capacity_share == 0.75 and more.find("interactive") is not None
    assert flow.find("batch").capacity_share == 0.5


# ---- arithmetic ----

def shot(tenant="light", klass="interactive", sent=0.0, status=200, first=None, done=None, tokens=(),
         retry_after=None, head=None, retry=None, error=None):
    s = bc.Shot(tenant, klass, sent, status=status, head_s=head if head is not None else sent, first_s=first,
                done_s=done, retry_after_s=retry_after, error=error, retry=retry)
    s.tokens = list(tokens)
    s.output_tokens = sum(n for _, n in tokens)
    return s


def test_ttft_stats_count_refusals_and_unanswered_apart():
    shots = [shot(sent=i, first=i + 0.1 * (i + 1), done=i + 2) for i in range(10)]
    shots += [shot(status=429), shot(status=None, error="no answer"), shot(first=1.0, error="stream ended")]
    stats = rep.ttft_stats(shots)
    assert stats == {"sent": 13, "answered": 10, "refused": 1, "unanswered": 2,
                     "ttft_p50_s": pytest.approx(0.55), "ttft_p99_s": pytest.approx(0.991)}
    assert rep.ttft_stats([])["ttft_p99_s"] is None


def test_window_counts_tokens_by_arrival_whichever_request():
    a = shot(tokens=[(1.0, 1), (5.0, 3), (9.9, 1), (10.0, 5)])
    b = shot(tokens=[(4.0, 2)], status=None)  # hung up on: what it got still counts
    assert rep.window_tokens([a, b], 2.0, 10.0) == 6
    assert rep.window_rate([a, b], 2.0, 10.0) == pytest.approx(0.75)
    assert rep.window_rate([a], 5.0, 5.0) == 0.0


def test_served_shares_against_weights():
    shares = rep.served_shares({"tenant-a": 750, "tenant-b": 250}, {"tenant-a": 1.0, "tenant-b": 1.0})
    assert shares["tenant-a"]["share"] == 0.75 and shares["tenant-a"]["weight_share"] == 0.5
    assert shares["tenant-a"]["ratio"] == 1.5 and shares["tenant-b"]["ratio"] == 0.5
    weighted = rep.served_shares({"tenant-a": 750, "tenant-b": 250}, {"tenant-a": 3.0, "tenant-b": 1.0})
    assert weighted["tenant-a"]["ratio"] == pytest.approx(1.0) == weighted["tenant-b"]["ratio"]
    assert rep.served_shares({}, {"tenant-a": 1.0, "tenant-b": 1.0})["tenant-a"]["ratio"] is None
    row = rep.shares_row([shot("tenant-a", "standard", tokens=[(5.0, 30), (1.0, 99)]),
                          shot("tenant-b", "standard", tokens=[(6.0, 10)]), shot("tenant-b", "standard", status=429)],
                         {"tenant-a": 1.0, "tenant-b": 1.0}, 2.0, 12.0)
    assert row["tenants"]["tenant-a"]["tokens"] == 30 and row["output_tok_s"] == 4.0
    assert row["refused"] == {"tenant-a": 0, "tenant-b": 1} and row["requests"] == {"tenant-a": 1, "tenant-b": 2}


def test_goodput_counts_targets_met_from_the_first_sending_through_a_retry():
    w = bc.Workload(target_interactive_s=1.0, target_batch_s=10.0)
    shots = [
        shot(sent=0.0, first=0.5, done=1.0),  # interactive, met
        shot(sent=1.0, first=2.5, done=3.0),  # interactive, missed
        shot("flood", "batch", sent=2.0, first=11.0, done=20.0),  # batch, met (9 s)
        # batch refused at 3.1 with Retry-After 4, retried at 7.1, first token at 9: met (6 s), waited 5.9 s
        shot("flood", "batch", sent=3.0, status=429, head=3.1, retry_after=4.0,
             retry=shot("flood", "batch", sent=7.1, first=9.0, done=12.0)),
        # refused twice: its Retry-After said 1 s; nothing came
        shot("flood", "batch", sent=4.0, status=429, head=4.0, retry_after=1.0,
             retry=shot("flood", "batch", sent=5.0, status=429)),
        shot("flood", "batch", sent=5.0, status=None, error="hung up"),
    ]
    row = rep.goodput_row(shots, w, 20.0, 0.3)
    assert row["met_target"] == 3 and row["goodput_per_s"] == pytest.approx(0.15)
    assert row["classes"]["interactive"] == {"arrivals": 2, "met_target": 1, "target_s": 1.0, "ttft_p50_s": 1.0,
                                             "ttft_p99_s": pytest.approx(1.49), "refused": 0}
    assert row["classes"]["batch"]["met_target"] == 2 and row["classes"]["batch"]["refused"] == 2
    honesty = row["retry_after"]
    assert honesty["retried"] == 2 and honesty["refused_again"] == 1
    assert honesty["actual_p50_s"] == pytest.approx(5.9)
    # ratios: 4 / 5.9 = 0.68 (within 2x) and 0 (refused again): median 0.34, half within
    assert honesty["ratio_p50"] == pytest.approx(4 / 5.9 / 2) and honesty["within_2x"] == 0.5
    assert rep.retry_honesty([]) == {"retried": 0, "refused_again": 0, "retry_after_p50_s": None,
                                     "actual_p50_s": None, "ratio_p50": None, "within_2x": None}


def _side(name, light_alone=0.3, light_under=0.5, lost=0, flood_alone=100.0, flood=95.0, shares=(0.52, 0.48),
          goodput=1.0, honest=1.2, same_under=0.4, same_lost=0):
    def ttft(p99, refused=0):
        return {"sent": 10, "answered": 10 - refused, "refused": refused, "unanswered": 0, "ttft_p50_s": p99 / 2,
                "ttft_p99_s": p99}

    tenants = {t: {"tokens": int(s * 1000), "share": s, "weight_share": 0.5, "ratio": s / 0.5}
               for t, s in zip(("tenant-a", "tenant-b"), shares, strict=True)}
    klass = {"arrivals": 10, "met_target": 5, "target_s": 1.0, "ttft_p50_s": 0.5, "ttft_p99_s": 3.0, "refused": 0}
    return {"side": name, "capacity_tok_s": 100.0,
            "noisy": {"light_alone": ttft(light_alone), "light_under_flood": ttft(light_under, lost),
                      "light_p99_ratio": light_under / light_alone, "flood_alone_tok_s": flood_alone,
                      "flood_tok_s": flood, "flood_ratio": flood / flood_alone},
            "shares": {"tenants": tenants, "output_tok_s": 90.0, "refused": {"tenant-a": 0, "tenant-b": 0}},
            "same_class": {"light_alone": ttft(0.2), "light_under_flood": ttft(same_under, same_lost),
                           "light_p99_ratio": same_under / 0.2, "flood": ttft(5.0, 4)},
            "goodput": {"goodput_per_s": goodput, "rate_per_s": 2.8, "classes": {"interactive": klass, "batch": klass},
                        "retry_after": {"retried": 3, "refused_again": 0, "retry_after_p50_s": 2.0,
                                        "actual_p50_s": 2.0, "ratio_p50": honest, "within_2x": 1.0}}}


def _result(*sides):
    return {"model": "smollm2-135m-instruct", "sides": list(sides), "durations": vars(bc.Durations()) | {},
            "workload": {**vars(bc.Workload())}, "deadlines_from_targets": True, "wall_s": 1800.0, "quick": False,
            "machine": {"cpus": 2}, "cpu": {"model": "AMD EPYC", "isa": ["avx2", "avx512f"]}}


def test_goal_lines_are_ratios_of_one_run_met_or_not():
    result = _result(_side("vllm-fcfs", light_under=100.0, shares=(0.75, 0.25), goodput=0.5),
                     _side("shunter-classes", goodput=1.0),
                     _side("shunter-classes-fcfs", light_under=0.7, lost=1, flood=80.0, shares=(0.6, 0.4),
                           goodput=0.7, honest=3.0, same_under=0.5, same_lost=2))
    lines = {(g["side"], g["goal"]): g for g in rep.goals(result)}
    assert {side for side, _ in lines} == {"shunter-classes", "shunter-classes-fcfs"}  # the peers have no goals
    ours = {goal: g for (side, goal), g in lines.items() if side == "shunter-classes"}
    assert all(g["met"] for g in ours.values()), ours
    assert ours["light TTFT p99: under the flood / alone"]["value"] == pytest.approx(0.5 / 0.3)
    assert ours["goodput at 2x overload: / vllm-fcfs's"]["value"] == 2.0
    fcfs = {goal: g["met"] for (side, goal), g in lines.items() if side == "shunter-classes-fcfs"}
    assert fcfs == {"light TTFT p99: under the flood / alone": False,  # 0.7 / 0.3 > 2
                    "light requests refused or unanswered under the flood": False,
                    "flood output tok/s: under contention / alone": False,  # 0.8
                    "same class: light requests refused or unanswered beside the flood": False,  # 2
                    "same class: light TTFT p99 beside the flood / alone": False,  # 0.5 / 0.2
                    "same-class tenants: served share / weight share (furthest from 1)": False,  # 1.2
                    "goodput at 2x overload: / vllm-fcfs's": False,  # 1.4
                    "Retry-After / the wait a retried request saw (median)": False}  # 3
    # without vLLM's own server in the run, or with no retries, the goal cannot be told: n/a, not met
    alone = _side("shunter-classes", honest=None)
    lines = {g["goal"]: g for g in rep.goals(_result(alone))}
    assert lines["goodput at 2x overload: / vllm-fcfs's"]["met"] is None
    assert lines["Retry-After / the wait a retried request saw (median)"]["met"] is None
    table = rep.goals_table(_result(alone))
    assert "| n/a |" in table and "| met |" in table


def test_report_has_one_table_per_workload_with_the_machine_beside_each():
    result = _result(_side("vllm-fcfs", goodput=0.5), _side("shunter-classes"))
    text = rep.report(result)
    tables = [block for block in text.split("\n\n") if block.startswith("| ")]
    assert len(tables) == 6  # noisy neighbour, shares, same class, goodput, Retry-After, goals
    assert text.count("CPU: AMD EPYC, 2 cores; ISA: avx2 avx512f") == 6
    assert "| shunter-classes | 0.10 / 0.20 | 0.20 / 0.40 | 2.00x | 0 / 0 (10) | 6 / 4 (10) |" in text
    lines = {g["goal"]: g["met"] for g in rep.goals(_result(_side("shunter-classes", same_under=0.5, same_lost=1)))}
    assert lines["same class: light requests refused or unanswered beside the flood"] is False
    assert lines["same class: light TTFT p99 beside the flood / alone"] is False, "2.5x its idle p99"
    assert "Not in this run" in rep.report(_result({k: v for k, v in _side("x").items() if k != "same_class"})
                                           | {"workload": {k: v for k, v in vars(bc.Workload()).items()
                                                           if not k.startswith("same_")}})
    assert "| shunter-classes | 0.15 / 0.30 | 0.25 / 0.50 | 1.67x |" in text
    assert "| shunter-classes | 10 / 10 | 5 / 5 | 1.00 | 2.00x |" in text
    section = rep.contention_section(result, 10)
    assert section.startswith("## 10. Contention") and "results/contention.json" in section and "30 min" in section


def test_cpu_model_and_isa_from_cpuinfo():
    text = ("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse4_1 sse4_2 avx avx2 fma avx512f "
            "avx512_bf16 amx_tile ht\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu\n")
    assert rep.cpu_info(text) == {"model": "AMD EPYC 9R14",
                                  "isa": ["amx_tile", "avx", "avx2", "avx512_bf16", "avx512f", "fma", "sse4_1",
                                          "sse4_2"]}
    assert rep.cpu_info("")["model"] == "unknown"
    assert rep.machine_line({"cpu": rep.cpu_info(text), "machine": {"cpus": 2}}).startswith("CPU: AMD EPYC 9R14, 2")


def test_retry_after_parsing():
    assert bc.parse_retry_after("5") == 5.0 and bc.parse_retry_after("0.5") == 0.5
    for bad in (None, "Wed, 21 Oct 2015 07:28:00 GMT", "-1", "nan", "inf"):
        assert bc.parse_retry_after(bad) is None


# ---- the client against a fake server ----

def _sse(tokens: int, continuous: bool = True) -> bytes:
    events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]}]
    # the second chunk carries two tokens (a server whose reader lagged merges them)
    done = 0
    for step in (1, 2, *([1] * (tokens - 3))):
        done += step
        event = {"choices": [{"delta": {"content": "x" * step}}]}
        if continuous:
            event["usage"] = {"completion_tokens": done}
        events.append(event)
    events.append({"choices": [], "usage": {"completion_tokens": tokens}})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _client(handler) -> bc.Client:
    return bc.Client("http://fake", "m", bc.SIDES["shunter-classes"], {"light": "k-light", "flood": "k-flood"},
                     transport=httpx.MockTransport(handler))


def test_client_counts_tokens_from_the_running_usage_and_sends_the_tenants_key():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.headers["authorization"], json.loads(request.content)))
        return httpx.Response(200, content=_sse(6, continuous="k-light" in request.headers["authorization"]))

    async def go():
        client = _client(handler)
        light, flood = bc.Shot("light", "interactive", 0.0), bc.Shot("flood", "batch", 0.0)
        await client.send(light, 6, 0.0, "q")
        await client.send(flood, 6, 0.0, "q")
        await client.close()
        return light, flood

    light, flood = asyncio.run(go())
    assert [h for h, _ in seen] == ["Bearer k-light", "Bearer k-flood"]
    assert light.ok and light.output_tokens == 6 and [n for _, n in light.tokens] == [1, 2, 1, 1, 1]
    assert light.first_s is not None and light.first_s == light.tokens[0][0]
    # no running usage: one token a content chunk, the rest when the final usage says so
    assert flood.ok and flood.output_tokens == 6 and [n for _, n in flood.tokens] == [1, 1, 1, 1, 1, 1]


def test_a_refusal_is_retried_once_after_its_retry_after():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            return httpx.Response(429, headers={"Retry-After": "0.2"}, json={"error": {"message": "full"}})
        if len(calls) == 2:
            return httpx.Response(200, content=_sse(4))
        return httpx.Response(503, headers={"Retry-After": "0.1"}, json={"error": {"message": "gone"}})

    async def go(arrivals, retry_until):
        client = _client(handler)
        shots: list[bc.Shot] = []
        import time

        await asyncio.gather(*bc.open_loop(client, arrivals, time.perf_counter(), shots, retry_until_s=retry_until))
        await client.close()
        return shots

    (first,) = asyncio.run(go([(0.0, "flood", "batch", 4)], 5.0))
    assert first.status == 429 and first.retry_after_s == 0.2 and first.retry is not None and first.retry.ok
    assert first.retry.sent_s - first.head_s >= 0.2
    (wait,) = rep.retry_waits([first])
    assert wait["retry_after_s"] == 0.2 and wait["actual_s"] >= 0.2
    # a refusal whose Retry-After falls after the arrivals' end is not retried; nor is one with no retry_until
    (late,) = asyncio.run(go([(0.0, "flood", "batch", 4)], 0.05))
    assert late.status == 503 and late.retry is None


def test_a_closed_loop_keeps_its_streams_busy_backs_off_after_a_refusal_and_hangs_up():
    flooding = {"now": 0, "most": 0}  # the flood's requests in flight at once

    async def handler(request: httpx.Request) -> httpx.Response:
        if "k-light" in request.headers["authorization"]:
            return httpx.Response(429, headers={"Retry-After": "10"}, json={"error": {"message": "full"}})
        flooding["now"] += 1
        flooding["most"] = max(flooding["most"], flooding["now"])
        try:
            await asyncio.sleep(0.05)
        finally:
            flooding["now"] -= 1
        return httpx.Response(200, content=_sse(4))

    async def go():
        import time

        client = _client(handler)
        shots: list[bc.Shot] = []
        loop = bc.ClosedLoop(client, ["flood", "flood", "light"], 4, time.perf_counter(), shots, ramp_s=0.1)
        deadline = time.monotonic() + 30
        while sum(s.tenant == "flood" for s in shots) < 6:  # a few rounds each, however slow the machine
            assert time.monotonic() < deadline, "the closed loop sent nothing"
            await asyncio.sleep(0.01)
        await loop.hang_up()
        await client.close()
        return shots

    shots = asyncio.run(go())
    flood = [s for s in shots if s.tenant == "flood"]
    assert len(flood) >= 6 and all(s.ok for s in flood[:-2])
    assert flooding["most"] == 2, "each of the two flood streams keeps one request in flight, never more"
    assert [s.status for s in shots if s.tenant == "light"] == [429]  # it waits its Retry-After, then is stopped
    assert {s.klass for s in flood} == {"batch"}
