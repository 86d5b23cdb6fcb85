"""`shunter bench routing`: routing policies side by side on the shared-prefix workload, 2 replicas.

For each policy the same model is deployed fresh (cold KV caches, new gateway, new router), driven by
the same seeded shared-prefix workload, and measured from both ends: the client's TTFT, end-to-end
latency and throughput, and the engines' own prefix-cache counters (prompt tokens looked up and found
cached), read from each replica by a pinned call before and after the run.

Policies: Shunter's `prefix_aware`, `least_connections`, `power_of_two` (Ray Serve's default) and Ray's
own `PrefixCacheAffinityRouter` (policy `custom`, its default settings).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

APP = "bench-routing"
RAY_PREFIX_ROUTER = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
POLICIES: dict[str, dict[str, Any]] = {
    "prefix_aware": {"policy": "prefix_aware"},
    "power_of_two": {"policy": "power_of_two"},
    "least_connections": {"policy": "least_connections"},
    "ray_prefix_cache_affinity": {"policy": "custom", "router_class": RAY_PREFIX_ROUTER},
}
# 16 system prompts x 4 users: the prompts of one group fit any replica's cache, so what separates the
# policies is whether a group's requests meet the replica that already prefilled its prompt.
WORKLOAD = ["--workload", "shared-prefix", "--groups", "16", "--users", "4", "--system-len", "1024",
            "--question-len", "uniform:16:32", "--output-len", "fixed:32", "--concurrency", "8",
            "--slo-ttft-ms", "2000", "--slo-itl-ms", "150", "--seed", "0"]


def replica_ids(handle: Any, expected: int) -> list[str]:
    """The ids of a deployment's `expected` running replicas (shared with `shunter bench lora`)."""
    seen: set[str] = set()
    for _ in range(200):  # unpinned calls spread over idle replicas at random
        seen.add(handle.stats.remote().result(timeout_s=60)["replica"])
        if len(seen) == expected:
            return sorted(seen)
    raise RuntimeError(f"found only {len(seen)} of {expected} replicas")


def _counters(handle: Any, replicas: list[str]) -> dict[str, dict[str, Any]]:
    from shunter.replica_protocol import RouteHint

    return {r: handle.stats.remote(RouteHint(pin=r)).result(timeout_s=60) for r in replicas}


def compare_routing(config: Path, model_name: str, policies: list[str], replicas: int = 2) -> dict[str, Any]:
    from ray import serve

    from shunter.bench.runner import run, run_parser
    from shunter.cli.app_files import generate_model_of
    from shunter.config import ShunterConfig
    from shunter.deployments.app import assemble
    from shunter.local_serve import local_serve
    from shunter.serve_plan import deployment_name

    cfg, model, _ = generate_model_of(config, model_name)
    rows = []
    with local_serve() as local:
        base = local.base_url
        for name in policies:
            spec = {**model.model_dump(mode="json"), "replicas": replicas, "routing": POLICIES[name]}
            app_cfg = ShunterConfig.model_validate({**cfg.model_dump(mode="json"), "models": [spec]})
            print(f"\n== {name}: deploying {replicas} fresh replicas", flush=True)
            local.deploy(assemble(app_cfg), APP)
            handle = serve.get_deployment_handle(deployment_name(app_cfg.models[0]), app_name=APP)
            ids = replica_ids(handle, replicas)
            before = _counters(handle, ids)
            result = run(run_parser().parse_args(["--base-url", f"{base}/v1", "--model", model.name, "--quiet",
                                                  "--label", name, *WORKLOAD]))
            after = _counters(handle, ids)
            queries = {r: after[r]["prefix_cache_queries"] - before[r]["prefix_cache_queries"] for r in ids}
            hits = {r: after[r]["prefix_cache_hits"] - before[r]["prefix_cache_hits"] for r in ids}
            total_q = sum(queries.values())
            rows.append({
                "policy": name,
                "summary": result["summary"],
                "workload": result["workload"],
                "engine_prefix_cache": {
                    "queries": total_q, "hits": sum(hits.values()),
                    "hit_rate": sum(hits.values()) / total_q if total_q else 0.0,
                    "prompt_tokens_share_per_replica": sorted((q / total_q if total_q else 0.0)
                                                              for q in queries.values()),
                },
                "result": result,
            })
            print(routing_table(rows[-1:]), flush=True)
            serve.delete(APP)
    return {"model": model.name, "replicas": replicas, "workload_options": WORKLOAD, "rows": rows}


def routing_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| policy | TTFT p50 | TTFT p90 | E2E p50 | output tok/s | goodput | engine prefix-cache hit rate "
             "| prompt tokens per replica | failed |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        s, cache = row["summary"], row["engine_prefix_cache"]
        split = " / ".join(f"{share:.0%}" for share in cache["prompt_tokens_share_per_replica"])
        lines.append(f"| {row['policy']} | {as_ms(s['ttft_s']['p50'])} | {as_ms(s['ttft_s']['p90'])} | "
                     f"{as_ms(s['e2e_s']['p50'])} | {s['output_tokens_per_s']:.1f} | {s['goodput']['fraction']:.2f} | "
                     f"{cache['hit_rate']:.1%} | {split} | {s['failed']} |")
    return "\n".join(lines)


def routing_section(result: dict[str, Any]) -> str:
    """Section 4 of docs/benchmarks.md."""
    import shlex

    rows = {row["policy"]: row for row in result["rows"]}
    ratios = []
    base = rows.get("prefix_aware")
    for other in ("power_of_two", "least_connections", "ray_prefix_cache_affinity"):
        if base and other in rows:
            ratio = rows[other]["summary"]["ttft_s"]["p50"] / base["summary"]["ttft_s"]["p50"]
            ratios.append(f"{other} {ratio:.1f}x")
    return f"""## 4. Routing policies, 2 replicas

`shunter bench routing`: {result['replicas']} replicas of `{result['model']}` (one core each), deployed fresh
for each policy (cold caches, a new gateway), then `shunter bench run {shlex.join(result['workload_options'])}`.
The engine columns come from the replicas' own prefix-cache counters (prompt tokens looked up and found
cached), read before and after each run.

{routing_table(result['rows'])}

TTFT p50 of each policy against `prefix_aware`: {', '.join(ratios) or 'n/a'} (higher is worse).
"""


def as_ms(seconds: float | None) -> str:
    """Seconds as a table cell of milliseconds (shared with `shunter bench lora`)."""
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shunter bench routing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of: {', '.join(POLICIES)}")
    parser.add_argument("--out", type=Path, default=Path("results/routing.json"))
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    from shunter.bench.runner import environment

    result = compare_routing(args.config, args.model, policies)
    print("\n" + routing_table(result["rows"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "routing", **result, **environment()}, indent=1))
    print(f"\nwritten to {args.out}")
    return 0
