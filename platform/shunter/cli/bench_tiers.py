"""`shunter bench tiers`: serve a tier config, send a mixed workload to `model: auto`, and report where it
went and what it cost against sending everything to the top tier.

The workload mixes the requests a general assistant gets: short factual questions and rewrites (most of
them), code, reasoning and arithmetic. Each answer's tier comes from its `x-shunter-tier` header and
its tokens from its usage; costs are the config's prices. The classifier's own cost is timed in this
process over the same bodies. The quality monitor runs as configured; its windows and promotions at the
end are in the report. Writes results/tiers.json and docs/benchmarks-tiers.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

APP = "shunter-bench-tiers"
TOPICS = ["France", "Japan", "the Moon", "photosynthesis", "the Roman Empire", "volcanoes", "the piano", "coffee"]
SIMPLE = ["What is the capital of {t}?", "Give me one fun fact about {t}.", "Say hello in three languages.",
          "Rewrite politely: send me the report now.", "What colour is the sky on a clear day?",
          "Name three fruits.", "Translate 'good morning' into Spanish.", "Who wrote Romeo and Juliet?"]
CODE = ["Write a Python function that checks whether a string is a palindrome.",
        "Fix this bug in my JavaScript: for (i = 0; i <= arr.length; i++) { total += arr[i]; }",
        "Write an SQL query that returns the ten most recent orders per customer."]
REASONING = ["Compare the trade-offs of microservices and a monolith for a team of five, step by step.",
             "Explain why the sky is blue, and justify each step of the reasoning."]
MATH = ["Solve for x: 3x + 7 = 22", "Calculate 17 * 23 and explain the method."]
MIX = (("simple", SIMPLE, 0.65), ("code", CODE, 0.15), ("reasoning", REASONING, 0.12), ("math", MATH, 0.08))


def mixed_workload(requests: int, seed: int = 0, max_tokens: int = 48) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    bodies = []
    for _ in range(requests):
        kind, prompts, _ = rng.choices(MIX, weights=[w for *_, w in MIX])[0]
        prompt = rng.choice(prompts).replace("{t}", rng.choice(TOPICS))
        bodies.append({"model": "auto", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "_kind": kind})
    return bodies


async def _drive(base: str, bodies: list[dict[str, Any]], concurrency: int) -> list[dict[str, Any]]:
    import httpx

    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    records: list[dict[str, Any]] = []

    async def worker(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            body = queue.get_nowait()
            sent = {k: v for k, v in body.items() if not k.startswith("_")}
            began = time.perf_counter()
            try:
                resp = await http.post("/v1/chat/completions", json=sent)
                usage = (resp.json().get("usage") or {}) if resp.status_code == 200 else {}
                records.append({"kind": body["_kind"], "status": resp.status_code,
                                "tier": resp.headers.get("x-shunter-tier"),
                                "reason": resp.headers.get("x-shunter-tier-reason", ""),
                                "prompt_tokens": usage.get("prompt_tokens", 0),
                                "completion_tokens": usage.get("completion_tokens", 0),
                                "latency_s": time.perf_counter() - began})
            except httpx.HTTPError as exc:
                records.append({"kind": body["_kind"], "status": type(exc).__name__, "tier": None})

    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return records


def classifier_cost_us(bodies: list[dict[str, Any]], rounds: int = 200) -> float:
    """Microseconds per request of the default classifier (features, score, class), in this process."""
    from shunter.routing.tiers import features

    start = time.perf_counter()
    for _ in range(rounds):
        for body in bodies:
            found = features(body)
            _ = found.complexity, found.request_class
    return (time.perf_counter() - start) / (rounds * len(bodies)) * 1e6


def summarize(records: list[dict[str, Any]], tiers: list[Any]) -> dict[str, Any]:
    """Split by tier and kind, tokens, and estimated cost routed vs all on the top tier."""
    by_name = {t.name: t for t in tiers}
    top = tiers[-1]
    answered = [r for r in records if r["status"] == 200 and r["tier"] in by_name]
    rows = []
    for tier in tiers:
        mine = [r for r in answered if r["tier"] == tier.name]
        prompt, completion = sum(r["prompt_tokens"] for r in mine), sum(r["completion_tokens"] for r in mine)
        rows.append({"tier": tier.name, "model": tier.model, "requests": len(mine),
                     "share": len(mine) / len(answered) if answered else 0.0,
                     "kinds": dict(Counter(r["kind"] for r in mine)),
                     "prompt_tokens": prompt, "completion_tokens": completion,
                     "cost": tier.cost(prompt, completion), "cost_if_top": top.cost(prompt, completion)})
    routed, all_top = sum(r["cost"] for r in rows), sum(r["cost_if_top"] for r in rows)
    return {"requests": len(records), "answered": len(answered), "failed": len(records) - len(answered),
            "tiers": rows, "cost_routed": routed, "cost_all_top": all_top,
            "savings": 1 - routed / all_top if all_top else 0.0}


def report(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = ["| tier | model | requests | share | kinds | prompt tokens | completion tokens | cost | cost on top tier |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in s["tiers"]:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["kinds"].items()))
        lines.append(f"| {r['tier']} | {r['model']} | {r['requests']} | {r['share']:.0%} | {kinds} | {r['prompt_tokens']} "
                     f"| {r['completion_tokens']} | ${r['cost']:.6f} | ${r['cost_if_top']:.6f} |")
    monitor = result["tier_status"]["monitor"]
    lines += ["", f"- {s['answered']}/{s['requests']} answered; estimated cost ${s['cost_routed']:.6f} routed vs "
              f"${s['cost_all_top']:.6f} all on the top tier: **{s['savings']:.0%} saved** at the config's prices.",
              f"- Classifier: {result['classifier_us']:.1f} µs per request (features, score, class), in one process.",
              f"- Monitor (sample_ratio {monitor['sample_ratio']}): windows {json.dumps(monitor['windows'])}; "
              f"promotions {json.dumps(result['tier_status']['promotions'])}."]
    return "\n".join(lines)


def bench_tiers(config: Path, requests: int, concurrency: int) -> dict[str, Any]:
    import httpx

    from shunter.cli.app_files import load_app_configs
    from shunter.deployments.app import assemble
    from shunter.deployments.gateway.tiering import Tiering
    from shunter.local_serve import local_serve

    (_, cfg), *_ = load_app_configs(config)
    if cfg.tiers is None:
        raise SystemExit(f"{config}: no `tiers:` section")
    tiers = Tiering(cfg).router.tiers
    bodies = mixed_workload(requests)
    with local_serve() as local:
        base = local.base_url
        local.deploy(assemble(cfg), APP)
        began = time.perf_counter()
        records = asyncio.run(_drive(base, bodies, concurrency))
        wall = time.perf_counter() - began
        time.sleep(5)  # the monitor's last comparisons
        status = httpx.get(f"{base}/admin/tiers", timeout=30).json()
    return {"benchmark": "tiers", "config": str(config), "concurrency": concurrency, "wall_s": wall,
            "summary": summarize(records, tiers), "classifier_us": classifier_cost_us(bodies),
            "tier_status": status, "records": records}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shunter bench tiers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/tiers.yaml"))
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("results/tiers.json"))
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks-tiers.md"))
    args = parser.parse_args(argv)
    from shunter.bench.runner import environment

    result = {**bench_tiers(args.config, args.requests, args.concurrency), **environment()}
    text = report(result)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    env = {"date": result["date"], "commit": result["commit"], "cpus": result["machine"]["cpus"],
           "memory_gib": result["machine"]["memory_gib"]}
    args.doc.write_text(f"# Complexity tiers: where a mixed workload goes\n\n`shunter bench tiers --config {args.config} "
                        f"--requests {args.requests} --concurrency {args.concurrency}` ({json.dumps(env)}).\n\n"
                        f"{text}\n")
    print(f"\nwritten to {args.out} and {args.doc}")
    return 0
