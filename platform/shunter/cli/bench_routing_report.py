"""What `shunter bench routing` reports: its tables, the issue's goals as ratios of one run, and the
sections of docs/benchmarks.md (4: shared-prefix; 7 and 8: under KV-cache pressure, fixed and scaling
out). Pure functions of a run's result (`shunter.cli.bench_routing.compare_routing`); no Ray."""

from __future__ import annotations

import json
from typing import Any


def pressure_line(row: dict[str, Any]) -> str:
    """The sizing claim of a run, checkable: distinct prompt tokens against one replica's KV capacity."""
    kv, w, oracle = row.get("kv_cache"), row["workload"], row.get("oracle")
    if not kv:
        return "KV capacity: not reported"
    tokens = (kv["blocks"] - 1) * kv["block_size"]  # one block is vLLM's null block
    line = f"KV capacity per replica: {kv['blocks'] - 1} usable blocks of {kv['block_size']} = {tokens:,} tokens"
    if "distinct_prefix_tokens" in w:
        line += (f"; distinct prompt tokens (workload, template left out) {w['distinct_prefix_tokens']:,} = "
                 f"{w['distinct_prefix_tokens'] / tokens:.1f}x")
    if oracle:
        line += (f"; distinct full prompt blocks sent {oracle['distinct_blocks']:,} = "
                 f"{oracle['distinct_over_capacity']:.1f}x")
    return line


def routing_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| policy | TTFT p50 | TTFT p90 | E2E p50 | output tok/s | goodput | engine prefix-cache hit rate "
             "| oracle hit rate | engine / oracle | prompt tokens per replica | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        s, cache = row["summary"], row["engine_prefix_cache"]
        split = " / ".join(f"{share:.0%}" for share in cache["prompt_tokens_share_per_replica"])
        oracle = (row.get("oracle") or {}).get("hit_rate")
        of_oracle = f"{cache['hit_rate'] / oracle:.2f}" if oracle else "n/a"
        lines.append(f"| {row['policy']} | {as_ms(s['ttft_s']['p50'])} | {as_ms(s['ttft_s']['p90'])} | "
                     f"{as_ms(s['e2e_s']['p50'])} | {s['output_tokens_per_s']:.1f} | {s['goodput']['fraction']:.2f} | "
                     f"{cache['hit_rate']:.1%} | {'n/a' if oracle is None else f'{oracle:.1%}'} | {of_oracle} | "
                     f"{split} | {s['failed']} |")
    return "\n".join(lines)


def _ttft(row: dict[str, Any], q: str = "p50") -> float | None:
    return row["summary"]["ttft_s"][q]


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals as ratios from this one run: each {goal, value, target, met} (value None: a
    policy it needs was not run). kv-pressure: precise's TTFT p50 >= 3x better than power_of_two's and
    >= 1.5x better than Ray's router's, its engine hit rate >= 90% of the oracle's; shared-prefix: precise
    no worse than approximate."""
    rows = {row["policy"]: row for row in result["rows"]}
    ours = rows.get("precise")
    out: list[dict[str, Any]] = []

    def ratio(goal: str, worse: float | None, better: float | None, target: float) -> None:
        value = worse / better if worse is not None and better else None
        out.append({"goal": goal, "value": value, "target": target,
                    "met": None if value is None else value >= target})

    def get(name: str, pick: Any) -> float | None:
        return pick(rows[name]) if ours is not None and name in rows else None

    if result.get("workload") == "kv-pressure":
        ratio("TTFT p50: power_of_two / precise", get("power_of_two", _ttft), get("precise", _ttft), 3.0)
        ratio("TTFT p50: ray_prefix_cache_affinity / precise", get("ray_prefix_cache_affinity", _ttft),
              get("precise", _ttft), 1.5)
        oracle = (ours or {}).get("oracle") or {}
        ratio("engine hit rate: precise / its oracle", (ours or {}).get("engine_prefix_cache", {}).get("hit_rate"),
              oracle.get("hit_rate"), 0.9)
    else:
        ratio("TTFT p50: approximate / precise", get("approximate", _ttft), get("precise", _ttft), 1.0)
        ratio("TTFT p90: approximate / precise", get("approximate", lambda r: _ttft(r, "p90")),
              get("precise", lambda r: _ttft(r, "p90")), 1.0)
        ratio("engine hit rate: precise / approximate", get("precise", _hit_rate), get("approximate", _hit_rate), 1.0)
    return out


def _hit_rate(row: dict[str, Any]) -> float:
    return row["engine_prefix_cache"]["hit_rate"]


def goals_lines(result: dict[str, Any]) -> str:
    lines = []
    for g in goals(result):
        mark = {True: "met", False: "not met", None: "n/a"}[g["met"]]
        value = "n/a" if g["value"] is None else f"{g['value']:.2f}"
        lines.append(f"- {g['goal']}: {value} (goal >= {g['target']:g}: {mark})")
    return "\n".join(lines)


def _against_precise(result: dict[str, Any]) -> str:
    rows = {row["policy"]: row for row in result["rows"]}
    base = rows.get("precise") or rows.get("prefix_aware")  # result files from before prefix_source
    ratios = []
    for other in ("approximate", "power_of_two", "least_connections", "ray_prefix_cache_affinity"):
        if base and other in rows and _ttft(base) and _ttft(rows[other]) is not None:
            ratios.append(f"{other} {_ttft(rows[other]) / _ttft(base):.1f}x")
    return ", ".join(ratios) or "n/a"


def routing_section(result: dict[str, Any], number: int = 4) -> str:
    """Section 4 of docs/benchmarks.md (the shared-prefix comparison)."""
    import shlex

    base = "precise" if any(r["policy"] == "precise" for r in result["rows"]) else "prefix_aware"
    goal = f"\n\n`precise` against `approximate` (the goal: no worse):\n\n{goals_lines(result)}" \
        if base == "precise" else ""
    return f"""## {number}. Routing policies, 2 replicas

`shunter bench routing`: {result['replicas']} replicas of `{result['model']}` (one core each), deployed fresh
for each policy (cold caches, a new gateway), then `shunter bench run {shlex.join(result['workload_options'])}`.
The engine columns come from the replicas' own prefix-cache counters (prompt tokens looked up and found
cached), read before and after each run; the oracle replays each run's prompts over caches of the engines'
size with perfect knowledge of them (`shunter.bench.kv_oracle`): the ceiling of the hit rate.

{routing_table(result['rows'])}

TTFT p50 of each policy against `{base}`: {_against_precise(result)} (higher is worse).{goal}
"""


def isolation_section(result: dict[str, Any], number: int = 9) -> str:
    """A section of docs/benchmarks.md: what per-tenant prompt caches cost (`--tenants N`), each policy's
    per-key run against its one-group run of the same run."""
    import shlex

    rows = {row["policy"]: row for row in result["rows"]}
    ratios = []
    for name, row in rows.items():
        if not name.endswith(" per-key"):
            continue
        shared = rows.get(name.replace(" per-key", " one-group"))
        mine, theirs = _ttft(row), _ttft(shared) if shared else None
        if mine is not None and theirs:
            ratios.append(f"{name.removesuffix(' per-key')}: TTFT p50 {mine / theirs:.2f}x, hit rate "
                          f"{row['engine_prefix_cache']['hit_rate']:.1%} against "
                          f"{shared['engine_prefix_cache']['hit_rate']:.1%}")  # type: ignore[index]
    tenants = next((r["tenants"]["keys"] for r in result["rows"] if r.get("tenants")), "?")
    return f"""## {number}. What tenant isolation costs

`shunter bench routing --tenants {tenants}`: {result['replicas']} replicas of `{result['model']}`, {tenants} API keys,
user u of each group sending with key u mod {tenants}, then `shunter bench run {shlex.join(result['workload_options'])}`.
`per-key` is the default (each key's prompt cache apart: a group's system prompt is prefilled once per
tenant); `one-group` puts the keys in one `cache_group` (the prompt is shared, as before isolation).

{routing_table(result['rows'])}

Per-key against one group, same run: {'; '.join(ratios) or 'n/a'} (higher TTFT is the cost).
"""


def kv_pressure_section(result: dict[str, Any], number: int = 7) -> str:
    """A section of docs/benchmarks.md: the kv-pressure comparison (`--workload kv-pressure`)."""
    import shlex

    rows = result["rows"]
    sizing = pressure_line(rows[0]).split("; distinct full")[0] if rows else "n/a"
    blocks = [(row["policy"], row["oracle"]) for row in rows if row.get("oracle")]
    if blocks:
        sizing += ("; distinct full prompt blocks each run really sent (chat template and answers included): "
                   + ", ".join(f"{name} {o['distinct_blocks']:,} ({o['distinct_over_capacity']:.1f}x)"
                               for name, o in blocks))
    extra = result["engine"].get("extra_engine_args", {})
    scale_out = result.get("scale_out")
    title = "scaling out under KV-cache pressure, 1 to" if scale_out else "Routing under KV-cache pressure,"
    fleet = (f"one replica of `{result['model']}` (one core), which the queue-depth autoscaler grows to "
             f"{result['replicas']} once requests queue (`autoscaling: {json.dumps(scale_out['autoscaling'])}`, "
             "the same for every policy)" if scale_out else f"{result['replicas']} replicas of `{result['model']}` "
             "(one core each)")
    return f"""## {number}. {title[0].upper() + title[1:]} {result['replicas']} replicas

`shunter bench routing --workload kv-pressure{' --scale-out' if scale_out else ''}`: {fleet} with a small KV cache
(vLLM `num_gpu_blocks_override: {extra.get('num_gpu_blocks_override')}`, `max_model_len:
{result['engine'].get('max_model_len')}`) behind {result.get('gateways', 1)} gateway replica(s), each with its own
router (as production runs several), deployed fresh for each policy, then
`shunter bench run {shlex.join(result['workload_options'])}`: long system prompts of Zipf-skewed popularity,
multi-turn sessions whose history grows (each turn resends the conversation with the server's answers),
{arrivals(result['workload_options'])}. The distinct prompt tokens outgrow one replica's cache. {sizing}.

The engine columns come from the replicas' own prefix-cache counters; the oracle replays each run's own
prompts, in the order they were sent, over LRU caches of the engines' size with perfect knowledge of them
and the same balance bound (`routing.max_load_gap`), ignoring timing, in-flight requests and decode blocks:
the ceiling of the hit rate (`shunter.bench.kv_oracle`).

{routing_table(rows)}

TTFT p50 of each policy against `precise`: {_against_precise(result)} (higher is worse).
{scale_out_table(rows) if scale_out else ""}
Goals, as ratios from this run:

{goals_lines(result)}
"""


def scale_out_table(rows: list[dict[str, Any]]) -> str:
    """A scale-out run's requests sent once the added replica was up (Serve's status, polled each second)."""
    lines = ["", "The requests sent once the second replica was up (seconds into the run, from Serve's status; "
             "each reply's `x-shunter-replica` says who served it):", "",
             "| policy | second replica up at | requests after | TTFT p50 after | TTFT p90 after | "
             "requests per replica after |", "|---|---|---|---|---|---|"]
    for row in rows:
        after = row.get("after_scale_out") or {}
        if after.get("second_replica_at_s") is None:
            lines.append(f"| {row['policy']} | never | | | | |")
            continue
        split = " / ".join(f"{share:.0%}" for share in after["shares"])
        lines.append(f"| {row['policy']} | {after['second_replica_at_s']:.0f} s | {after['requests']} | "
                     f"{as_ms(after['ttft_p50_s'])} | {as_ms(after['ttft_p90_s'])} | {split} |")
    return "\n".join(lines) + "\n"


def arrivals(options: list[str]) -> str:
    """How a run's sessions arrive, in words, from its `shunter bench run` options."""
    from shunter.bench.runner import run_parser

    args = run_parser().parse_args(options)
    if args.rate is None:
        return f"{args.concurrency or 8} sessions in flight at once (a closed loop)"
    together = f", {args.burst} sessions of one group at a time" if args.burst > 1 else ""
    return f"sessions starting at Poisson times, {args.rate:g} a second{together}, whatever the servers' pace"


def as_ms(seconds: float | None) -> str:
    """Seconds as a table cell of milliseconds (shared with `shunter bench lora`)."""
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"
