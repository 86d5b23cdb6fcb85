"""What `shunter bench contention` reports: each phase's numbers from its requests, the tables (one per
workload, the CPU model and ISA beside each), the issue's goals as ratios of one run with met / not met,
and the section of docs/benchmarks.md. Pure functions of a run's requests and result; no engines, no Ray.

Goals (issue 38), each for every Shunter side with classes:
- the light interactive tenant's TTFT p99 under the flood <= 2x its p99 on the idle system, none of its
  requests refused (nor left unanswered);
- the flood's output tokens/s under contention >= 0.9 of its flood-alone value;
- same-class tenants' served output-token shares within 10% of their weight shares (served / weight share
  in [0.9, 1.1] for each);
- goodput at 2x overload >= 1.5x vLLM's own server's (`vllm-fcfs`);
- Retry-After within 2x of the wait a retried request actually saw (the median of Retry-After / wait in
  [0.5, 2]; a retry refused again counts as ratio 0: the wait was longer than said).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

ISA_PREFIXES = ("sse4", "avx", "amx", "fma", "f16c", "vnni", "bf16", "asimd", "sve", "neon")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU model and the ISA extensions engines care about (SSE4, AVX*, AMX, FMA, VNNI, BF16; on ARM
    ASIMD, SVE), from /proc/cpuinfo (or its text)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model, flags = "unknown", []
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and model == "unknown":
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = sorted(f for f in value.split() if f.startswith(ISA_PREFIXES))
    return {"model": model, "isa": flags}


def machine_line(result: dict[str, Any]) -> str:
    """One line naming the machine: what every table of the run is only meaningful with."""
    cpu = result.get("cpu") or {}
    machine = result.get("machine") or {}
    cpus = machine.get("cpus")
    isa = " ".join(cpu.get("isa") or []) or "unknown"
    return (f"CPU: {cpu.get('model', 'unknown')}" + (f", {cpus} cores" if cpus else "") + f"; ISA: {isa}")


def quantile(values: Sequence[float], q: float) -> float | None:
    """shunter.bench.stats.percentile (q in [0, 100]); None without values."""
    from shunter.bench.stats import percentile

    return percentile(list(values), q) if values else None


def ttft_stats(shots: Iterable[Any]) -> dict[str, Any]:
    """A tenant's requests: sent, answered (200, complete), refused (any status but 200), unanswered (no status
    or a broken stream), TTFT p50/p99 of the answered."""
    shots = list(shots)
    answered = [s for s in shots if s.ok and s.ttft_s is not None]
    refused = [s for s in shots if s.status is not None and s.status != 200]
    ttfts = [s.ttft_s for s in answered]
    return {"sent": len(shots), "answered": len(answered), "refused": len(refused),
            "unanswered": len(shots) - len(answered) - len(refused),
            "ttft_p50_s": quantile(ttfts, 50), "ttft_p99_s": quantile(ttfts, 99)}


def window_tokens(shots: Iterable[Any], start_s: float, end_s: float) -> int:
    """Output tokens that arrived in [start_s, end_s) on the phase's clock, whichever request carried them."""
    return sum(n for s in shots for t, n in s.tokens if start_s <= t < end_s)


def window_rate(shots: Iterable[Any], start_s: float, end_s: float) -> float:
    return window_tokens(shots, start_s, end_s) / (end_s - start_s) if end_s > start_s else 0.0


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def noisy_row(alone: list[Any], under: list[Any], flood_alone: list[Any], flooded: list[Any], d: Any,
              ran_s: float) -> dict[str, Any]:
    """Workload 1 on one side."""
    light_alone, light_under = ttft_stats(alone), ttft_stats(under)
    alone_rate = window_rate(flood_alone, d.settle_s, d.flood_alone_s)
    under_rate = window_rate(flooded, d.settle_s, d.flood_s)
    return {
        "light_alone": light_alone, "light_under_flood": light_under,
        "light_p99_ratio": ratio(light_under["ttft_p99_s"], light_alone["ttft_p99_s"]),
        "flood_alone_tok_s": alone_rate, "flood_tok_s": under_rate, "flood_ratio": ratio(under_rate, alone_rate),
        "flood_refused": sum(1 for s in [*flood_alone, *flooded] if s.status is not None and s.status != 200),
        "flood_phase_s": ran_s,
        "light_requests": {"alone": [s.brief() for s in alone], "under_flood": [s.brief() for s in under]},
    }


def same_class_row(alone: list[Any], under: list[Any], flooded: list[Any]) -> dict[str, Any]:
    """The same-class workload on one side: the light tenant alone and beside its class's flood."""
    light_alone, light_under = ttft_stats(alone), ttft_stats(under)
    return {"light_alone": light_alone, "light_under_flood": light_under,
            "light_p99_ratio": ratio(light_under["ttft_p99_s"], light_alone["ttft_p99_s"]),
            "flood": ttft_stats(flooded)}


def served_shares(tokens: dict[str, int], weights: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Each tenant's share of the served tokens against its share of the weights (`ratio` = served / weight
    share; 1 is exact)."""
    total, weight = sum(tokens.values()), sum(weights.values())
    out = {}
    for tenant, w in weights.items():
        share = tokens.get(tenant, 0) / total if total else 0.0
        out[tenant] = {"tokens": tokens.get(tenant, 0), "share": share, "weight_share": w / weight,
                       "ratio": share / (w / weight) if total else None}
    return out


def shares_row(shots: list[Any], weights: dict[str, float], start_s: float, end_s: float) -> dict[str, Any]:
    """Workload 2 on one side: the tokens each tenant was served in the window."""
    tokens = {t: window_tokens((s for s in shots if s.tenant == t), start_s, end_s) for t in weights}
    return {"window_s": [start_s, end_s], "tenants": served_shares(tokens, weights),
            "output_tok_s": sum(tokens.values()) / (end_s - start_s),
            "requests": {t: sum(1 for s in shots if s.tenant == t) for t in weights},
            "refused": {t: sum(1 for s in shots if s.tenant == t and s.status not in (None, 200)) for t in weights}}


def eventual_ttft(shot: Any) -> float | None:
    """From the request's first sending to its first token, through its retry if it was refused."""
    if shot.first_s is not None:
        return shot.first_s - shot.sent_s
    if shot.retry is not None and shot.retry.first_s is not None:
        return shot.retry.first_s - shot.sent_s
    return None


def met_target(shot: Any, target_s: float) -> bool:
    ttft = eventual_ttft(shot)
    return ttft is not None and ttft <= target_s


def retry_waits(shots: Iterable[Any]) -> list[dict[str, Any]]:
    """Each retried refusal: the Retry-After it was given and the wait it then saw, from the refusal to the
    retry's first token (None: the retry was refused again or never answered)."""
    out = []
    for s in shots:
        if s.retry is None or s.retry_after_s is None or s.head_s is None:
            continue
        actual = s.retry.first_s - s.head_s if s.retry.first_s is not None else None
        out.append({"retry_after_s": s.retry_after_s, "actual_s": actual, "retry_status": s.retry.status})
    return out


def retry_honesty(waits: list[dict[str, Any]]) -> dict[str, Any]:
    """Retry-After / the actual wait over the retries: median, and the share within 2x either way. A retry
    with no first token counts as ratio 0 (the wait was longer than any number)."""
    ratios = [(w["retry_after_s"] / max(w["actual_s"], 1e-3)) if w["actual_s"] is not None else 0.0 for w in waits]
    seen = [w["actual_s"] for w in waits if w["actual_s"] is not None]
    return {"retried": len(waits), "refused_again": sum(1 for w in waits if w["actual_s"] is None),
            "retry_after_p50_s": quantile([w["retry_after_s"] for w in waits], 50),
            "actual_p50_s": quantile(seen, 50),
            "ratio_p50": statistics.median(ratios) if ratios else None,
            "within_2x": sum(1 for r in ratios if 0.5 <= r <= 2.0) / len(ratios) if ratios else None}


def goodput_row(shots: list[Any], w: Any, duration_s: float, rate: float) -> dict[str, Any]:
    """Workload 3 (and 4) on one side."""
    by_class: dict[str, Any] = {}
    good_total = 0
    for klass in ("interactive", "batch"):
        mine = [s for s in shots if s.klass == klass]
        target = w.target_s(klass)
        good = sum(1 for s in mine if met_target(s, target))
        good_total += good
        ttfts = [t for t in (eventual_ttft(s) for s in mine) if t is not None]
        by_class[klass] = {"arrivals": len(mine), "met_target": good, "target_s": target,
                           "ttft_p50_s": quantile(ttfts, 50), "ttft_p99_s": quantile(ttfts, 99),
                           "refused": sum(1 for s in mine if s.status not in (None, 200))}
    waits = retry_waits(shots)
    return {"rate_per_s": rate, "duration_s": duration_s, "arrivals": len(shots), "met_target": good_total,
            "goodput_per_s": good_total / duration_s, "classes": by_class,
            "retries": waits, "retry_after": retry_honesty(waits)}


# ---- goals ----

def _goal(goal: str, side: str, value: float | None, target: str, met: bool | None) -> dict[str, Any]:
    return {"goal": goal, "side": side, "value": value, "target": target, "met": met}


def _within(value: float | None, low: float, high: float) -> bool | None:
    return None if value is None else low <= value <= high


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals for each Shunter side with classes (`shunter-classes`, `shunter-classes-fcfs`,
    `shunter-classes-share75`)."""
    rows = {r["side"]: r for r in result["sides"]}
    server = rows.get("vllm-fcfs")
    out = []
    for name in ("shunter-classes", "shunter-classes-fcfs", "shunter-classes-share75"):
        row = rows.get(name)
        if row is None:
            continue
        noisy, shares, good = row["noisy"], row["shares"], row["goodput"]
        p99 = noisy["light_p99_ratio"]
        out.append(_goal("light TTFT p99: under the flood / alone", name, p99, "<= 2",
                         None if p99 is None else p99 <= 2.0))
        under = noisy["light_under_flood"]
        lost = under["refused"] + under["unanswered"]
        out.append(_goal("light requests refused or unanswered under the flood", name, lost, "0", lost == 0))
        flood = noisy["flood_ratio"]
        out.append(_goal("flood output tok/s: under contention / alone", name, flood, ">= 0.9",
                         None if flood is None else flood >= 0.9))
        same = row.get("same_class")
        if same is not None:
            lost = same["light_under_flood"]["refused"] + same["light_under_flood"]["unanswered"]
            out.append(_goal("same class: light requests refused or unanswered beside the flood", name, lost, "0",
                             lost == 0))
            p99 = same["light_p99_ratio"]
            out.append(_goal("same class: light TTFT p99 beside the flood / alone", name, p99, "<= 2",
                             None if p99 is None else p99 <= 2.0))
        worst = _worst_share(shares)
        out.append(_goal("same-class tenants: served share / weight share (furthest from 1)", name, worst,
                         "0.9 - 1.1", _within(worst, 0.9, 1.1)))
        vs = ratio(good["goodput_per_s"], server["goodput"]["goodput_per_s"]) if server else None
        out.append(_goal("goodput at 2x overload: / vllm-fcfs's", name, vs, ">= 1.5",
                         None if vs is None else vs >= 1.5))
        honest = good["retry_after"]["ratio_p50"]
        out.append(_goal("Retry-After / the wait a retried request saw (median)", name, honest, "0.5 - 2",
                         _within(honest, 0.5, 2.0)))
    return out


def _worst_share(shares: dict[str, Any]) -> float | None:
    ratios = [t["ratio"] for t in shares["tenants"].values() if t["ratio"] is not None]
    return max(ratios, key=lambda r: abs(r - 1)) if ratios else None


# ---- tables ----

def _s(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def noisy_table(result: dict[str, Any]) -> str:
    lines = ["| side | light TTFT alone p50 / p99 s | under the flood p50 / p99 s | p99 under / alone "
             "| light refused / unanswered (of sent) | flood tok/s alone | under contention | contention / alone "
             "| flood refused |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["sides"]:
        n, a, u = r["noisy"], r["noisy"]["light_alone"], r["noisy"]["light_under_flood"]
        lines.append(f"| {r['side']} | {_s(a['ttft_p50_s'])} / {_s(a['ttft_p99_s'])} | {_s(u['ttft_p50_s'])} / "
                     f"{_s(u['ttft_p99_s'])} | {_x(n['light_p99_ratio'])} | {u['refused']} / {u['unanswered']} "
                     f"({u['sent']}) | {n['flood_alone_tok_s']:.1f} | {n['flood_tok_s']:.1f} | {_x(n['flood_ratio'])} | "
                     f"{n.get('flood_refused', 0)} |")
    return "\n".join(lines)


def same_class_table(result: dict[str, Any]) -> str:
    lines = ["| side | light TTFT alone p50 / p99 s | beside its class's flood p50 / p99 s | p99 beside / alone "
             "| light refused / unanswered (of sent) | flood answered / refused (of sent) |",
             "|---|---|---|---|---|---|"]
    for r in result["sides"]:
        c = r.get("same_class")
        if c is None:
            continue
        a, u, f = c["light_alone"], c["light_under_flood"], c["flood"]
        lines.append(f"| {r['side']} | {_s(a['ttft_p50_s'])} / {_s(a['ttft_p99_s'])} | {_s(u['ttft_p50_s'])} / "
                     f"{_s(u['ttft_p99_s'])} | {_x(c['light_p99_ratio'])} | {u['refused']} / {u['unanswered']} "
                     f"({u['sent']}) | {f['answered']} / {f['refused']} ({f['sent']}) |")
    return "\n".join(lines)


def shares_table(result: dict[str, Any]) -> str:
    lines = ["| side | tenant-a served share (weight share) | tenant-b served share (weight share) "
             "| served / weight share: a / b | output tok/s | refused a / b |", "|---|---|---|---|---|---|"]
    for r in result["sides"]:
        s = r["shares"]
        a, b = s["tenants"]["tenant-a"], s["tenants"]["tenant-b"]
        lines.append(f"| {r['side']} | {a['share']:.1%} ({a['weight_share']:.0%}) | {b['share']:.1%} "
                     f"({b['weight_share']:.0%}) | {_s(a['ratio'])} / {_s(b['ratio'])} | {s['output_tok_s']:.1f} | "
                     f"{s['refused']['tenant-a']} / {s['refused']['tenant-b']} |")
    return "\n".join(lines)


def goodput_table(result: dict[str, Any]) -> str:
    rows = {r["side"]: r for r in result["sides"]}
    base = rows.get("vllm-fcfs")
    lines = ["| side | arrivals interactive / batch | met target interactive / batch | goodput req/s "
             "| / vllm-fcfs | interactive TTFT p50 / p99 s | batch TTFT p50 / p99 s | refused interactive / batch |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["sides"]:
        g = r["goodput"]
        i, b = g["classes"]["interactive"], g["classes"]["batch"]
        vs = ratio(g["goodput_per_s"], base["goodput"]["goodput_per_s"]) if base else None
        lines.append(f"| {r['side']} | {i['arrivals']} / {b['arrivals']} | {i['met_target']} / {b['met_target']} | "
                     f"{g['goodput_per_s']:.2f} | {_x(vs)} | {_s(i['ttft_p50_s'])} / {_s(i['ttft_p99_s'])} | "
                     f"{_s(b['ttft_p50_s'])} / {_s(b['ttft_p99_s'])} | {i['refused']} / {b['refused']} |")
    return "\n".join(lines)


def retry_table(result: dict[str, Any]) -> str:
    lines = ["| side | refusals retried | refused again | Retry-After p50 s | wait seen p50 s "
             "| Retry-After / wait, median | within 2x |", "|---|---|---|---|---|---|---|"]
    for r in result["sides"]:
        h = r["goodput"]["retry_after"]
        within = "-" if h["within_2x"] is None else f"{h['within_2x']:.0%}"
        lines.append(f"| {r['side']} | {h['retried']} | {h['refused_again']} | {_s(h['retry_after_p50_s'], 1)} | "
                     f"{_s(h['actual_p50_s'], 1)} | {_s(h['ratio_p50'])} | {within} |")
    return "\n".join(lines)


def goals_table(result: dict[str, Any]) -> str:
    lines = ["| goal | side | value | target | |", "|---|---|---|---|---|"]
    for g in goals(result):
        value = g["value"]
        shown = "-" if value is None else (str(value) if isinstance(value, int) else f"{value:.2f}")
        verdict = {True: "met", False: "not met", None: "n/a"}[g["met"]]
        lines.append(f"| {g['goal']} | {g['side']} | {shown} | {g['target']} | {verdict} |")
    return "\n".join(lines)


def _settings(result: dict[str, Any]) -> str:
    d, w = result["durations"], result["workload"]
    return (f"light tenant: one {w['light_tokens']}-token chat every {d['light_interval_s']:g} s, "
            f"{d['light_alone_s']:g} s alone; flood: {w['flood_streams']} streams of {w['flood_tokens']} tokens, "
            f"{d['flood_alone_s']:g} s alone, {d['flood_s']:g} s with the light tenant (first {d['settle_s']:g} s "
            f"left out of tok/s)")


def _same_class_settings(w: dict[str, Any], d: dict[str, Any]) -> str:
    # Runs from before the workload carry neither its fields nor its rows.
    if "same_flood_streams" not in w:
        return "Not in this run"
    return (f"Both in class standard: {w['same_flood_streams']} streams of {w['same_flood_tokens']} tokens, and one "
            f"{w['same_light_tokens']}-token chat every {d['same_light_interval_s']:g} s, {d['same_light_alone_s']:g} s "
            f"alone, then {d['same_class_s']:g} s beside the flood")


def report(result: dict[str, Any]) -> str:
    """Every table of a run, the machine beside each, and the goal lines."""
    w, d = result["workload"], result["durations"]
    machine = machine_line(result)
    capacity = next((r["capacity_tok_s"] for r in result["sides"]), None)
    good = next((r["goodput"] for r in result["sides"]), None)
    mix = (f"{w['interactive_share']:.0%} interactive ({w['interactive_tokens']} tokens, TTFT target "
           f"{w['target_interactive_s']:g} s), the rest batch ({w['batch_tokens']} tokens, target "
           f"{w['target_batch_s']:g} s), {w['overload']:g}x the capacity ({_s(capacity, 1)} output tok/s: "
           f"{_s(good['rate_per_s'] if good else None)} arrivals/s) for {d['goodput_s']:g} s")
    return f"""### Noisy neighbour

{_settings(result)}. {machine}

{noisy_table(result)}

### Two tenants of one class at {w['share_streams'][0]}:{w['share_streams'][1]}

{w['share_streams'][0]} and {w['share_streams'][1]} streams of {w['share_tokens']} tokens, key weights \
{w['share_weights'][0]:g}:{w['share_weights'][1]:g} (Shunter), {d['shares_s']:g} s, output tokens counted from \
{d['shares_settle_s']:g} s. {machine}

{shares_table(result)}

### A light tenant beside a flood of its own class

{_same_class_settings(w, d)}. {machine}

{same_class_table(result)}

### Goodput at {w['overload']:g}x overload

{mix}; a refusal with Retry-After is sent again once after it. {machine}

{goodput_table(result)}

### Retry-After against the wait a retried request saw

From the refusal to the retry's first token. {machine}

{retry_table(result)}

### Goals (ratios, this run)

{machine}

{goals_table(result)}"""


def contention_section(result: dict[str, Any], number: int = 10) -> str:
    """A section of docs/benchmarks.md."""
    sides = ", ".join(f"`{r['side']}`" for r in result["sides"])
    deadlines = ("each class's queueing deadline set to its goodput TTFT target" if result.get("deadlines_from_targets")
                 else "the built-in class deadlines")
    return f"""## {number}. Contention: priorities, fair shares, honest waits

`shunter bench contention` (data: `results/contention.json`): one replica of `{result['model']}` on every
core, the same engine settings on every side ({sides}), all in one run. vLLM's own server first come first
served, and with `--scheduling-policy priority` told each request's class as its `priority`; Shunter with a
key per tenant, all in one class and an fcfs engine (`shunter-no-classes`), and with the tenants' classes
(light: interactive, flood: batch, the two same-class tenants: standard), `scheduling_policy: priority` and
{deadlines} (`shunter-classes`). Took {result['wall_s'] / 60:.0f} min{' (--quick)' if result.get('quick') else ''}.

{report(result)}"""
