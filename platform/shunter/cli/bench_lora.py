"""`shunter bench lora`: many LoRA adapters under a skewed mix on 2 replicas, adapter-aware routing
against least-connections and power-of-two.

N adapters of the builtin SmolLM2 (made here, seeded: `shunter.bench.lora_adapters`), more than the two
replicas hold together, asked for in a Zipf mix (`shunter bench run --workload adapters`: a few adapters
take most requests). For each policy the model is deployed fresh, no adapter loaded anywhere, and measured
from both ends: the client's TTFT and throughput, and the replicas' own adapter counters (loads per 100
requests, seconds spent loading), read from each replica by a pinned call before and after the run.

It also measures what `routing.adapter_load_tokens` stands for: the mean time a replica took to load an
adapter, and the engine's prefill rate (a 1,024-token prompt, one output token, on an idle replica); and
`routing.adapter_busy_tokens`: half a request's decode time at that rate.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

APP = "bench-lora"
POLICIES: dict[str, dict[str, Any]] = {
    "adapter_aware": {"policy": "prefix_aware"},  # Shunter's cost model: prefixes and held adapters vs load
    "least_connections": {"policy": "least_connections"},
    "power_of_two": {"policy": "power_of_two"},  # Ray Serve's default
}
ADAPTERS = 8
# One adapter in a batch, two in host memory per replica: 8 adapters are twice what two replicas hold.
ENGINE = {"max_loras": 1, "max_cpu_loras": 2, "max_lora_rank": 8}
WORKLOAD = ["--workload", "adapters", "--requests", "160", "--zipf", "1.1", "--input-len", "uniform:32:96",
            "--output-len", "fixed:16", "--concurrency", "6", "--seed", "0"]


def _counters(handle: Any, replicas: list[str]) -> dict[str, dict[str, Any]]:
    from shunter.replica_protocol import RouteHint

    return {r: handle.stats.remote(RouteHint(pin=r)).result(timeout_s=60) for r in replicas}


def _prefill_rate(base_url: str, model: str, tokenizer_spec: str) -> float:
    """Prompt tokens per second of a cold 1,024-token prompt with one output token (best of three)."""
    import random

    import httpx

    from shunter.bench.runner import load_tokenizer
    from shunter.bench.workloads import TextMaker

    maker = TextMaker(load_tokenizer(tokenizer_spec))
    rng = random.Random(7)
    best = 0.0
    for _ in range(3):
        text, tokens = maker.make(1024, rng)
        started = time.perf_counter()
        resp = httpx.post(f"{base_url}/v1/completions", timeout=300,
                          json={"model": model, "prompt": text, "max_tokens": 1, "temperature": 0})
        resp.raise_for_status()
        best = max(best, resp.json()["usage"]["prompt_tokens"] / (time.perf_counter() - started))
    return best


def compare_lora(config: Path, model_name: str, policies: list[str], adapters: int = ADAPTERS,
                 replicas: int = 2) -> dict[str, Any]:
    from ray import serve

    from shunter.bench.lora_adapters import make_adapter
    from shunter.bench.runner import run, run_parser
    from shunter.cli.app_files import generate_model_of
    from shunter.cli.bench_routing import replica_ids
    from shunter.config import ShunterConfig
    from shunter.deployments.app import assemble
    from shunter.local_serve import local_serve
    from shunter.serve_plan import deployment_name

    cfg, model, path = generate_model_of(config, model_name)
    names = [f"tune-{i:02d}" for i in range(adapters)]
    rows, measured = [], {}
    with tempfile.TemporaryDirectory(prefix="shunter-bench-lora-") as folder, local_serve() as local:
        print(f"making {adapters} LoRA adapters of {model.name}", flush=True)
        dirs = {name: make_adapter(path, Path(folder) / name, seed=i + 1) for i, name in enumerate(names)}
        base = local.base_url
        for policy in policies:
            spec = {**model.model_dump(mode="json"), "replicas": replicas, "routing": POLICIES[policy],
                    "engine": {**model.engine.model_dump(mode="json"), **ENGINE},
                    "adapters": [{"name": n, "source": d} for n, d in dirs.items()]}
            app_cfg = ShunterConfig.model_validate({**cfg.model_dump(mode="json"), "models": [spec]})
            print(f"\n== {policy}: deploying {replicas} fresh replicas", flush=True)
            local.deploy(assemble(app_cfg), APP)
            handle = serve.get_deployment_handle(deployment_name(app_cfg.models[0]), app_name=APP)
            ids = replica_ids(handle, replicas)
            if not measured:
                measured["prefill_tokens_per_s"] = _prefill_rate(base, model.name, model.source or path)
            before = _counters(handle, ids)
            result = run(run_parser().parse_args(["--base-url", f"{base}/v1", "--model", model.name, "--quiet",
                                                  "--label", policy, "--adapters", ",".join(names), *WORKLOAD]))
            after = _counters(handle, ids)
            loads = sum(sum(after[r]["adapter_loads"].values()) - sum(before[r]["adapter_loads"].values())
                        for r in ids)
            seconds = sum(after[r]["adapter_load_seconds"] - before[r]["adapter_load_seconds"] for r in ids)
            requests = result["summary"]["requests"]
            rows.append({"policy": policy, "summary": result["summary"], "workload": result["workload"],
                         "adapter_loads": loads, "adapter_load_seconds": seconds,
                         "loads_per_100_requests": 100 * loads / requests if requests else 0.0,
                         "result": result})
            if loads:
                measured.setdefault("load_s", []).append(seconds / loads)
            print(lora_table(rows[-1:]), flush=True)
            serve.delete(APP)
    load_s = sum(measured.get("load_s", [0.0])) / max(1, len(measured.get("load_s", [])))
    rate = measured.get("prefill_tokens_per_s", 0.0)
    decode_s = [r["summary"]["e2e_s"]["p50"] - r["summary"]["ttft_s"]["p50"] for r in rows
                if r["summary"]["e2e_s"]["p50"] is not None and r["summary"]["ttft_s"]["p50"] is not None]
    decode_s = sum(decode_s) / len(decode_s) if decode_s else 0.0
    # A request held back for a slot waits out the adapters running there: about half a decode.
    cost = {"adapter_load_s": load_s, "prefill_tokens_per_s": rate, "adapter_load_tokens": round(load_s * rate),
            "decode_s": decode_s, "adapter_busy_tokens": round(decode_s / 2 * rate)}
    return {"model": model.name, "replicas": replicas, "adapters": adapters, "engine": ENGINE,
            "workload_options": WORKLOAD, "load_cost": cost, "rows": rows}


def lora_table(rows: list[dict[str, Any]]) -> str:
    from shunter.cli.bench_routing_report import as_ms

    lines = ["| policy | TTFT p50 | TTFT p90 | E2E p50 | output tok/s | adapter loads per 100 requests "
             "| seconds loading | failed |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        s = row["summary"]
        lines.append(f"| {row['policy']} | {as_ms(s['ttft_s']['p50'])} | {as_ms(s['ttft_s']['p90'])} | "
                     f"{as_ms(s['e2e_s']['p50'])} | {s['output_tokens_per_s']:.1f} | "
                     f"{row['loads_per_100_requests']:.1f} | {row['adapter_load_seconds']:.1f} | {s['failed']} |")
    return "\n".join(lines)


def lora_section(result: dict[str, Any], number: int = 6) -> str:
    """A section of docs/benchmarks.md."""
    import shlex

    rows = {row["policy"]: row for row in result["rows"]}
    ours, ratios = rows.get("adapter_aware"), []
    for other in ("least_connections", "power_of_two"):
        if ours and other in rows:
            o, t = rows[other], ours
            ratios.append(f"- against {other}: TTFT p50 {_ratio(o['summary']['ttft_s']['p50'], t['summary']['ttft_s']['p50'])}, "
                          f"p90 {_ratio(o['summary']['ttft_s']['p90'], t['summary']['ttft_s']['p90'])}, "
                          f"adapter loads {_ratio(o['adapter_loads'], t['adapter_loads'])}, output tok/s "
                          f"{_ratio(t['summary']['output_tokens_per_s'], o['summary']['output_tokens_per_s'])} "
                          "(each: how many times better adapter_aware is)")
    cost = result["load_cost"]
    return f"""## {number}. LoRA adapters, 2 replicas

`shunter bench lora`: {result['adapters']} LoRA adapters (rank 8, seeded) of `{result['model']}` on
{result['replicas']} replicas (one core each; engine {json.dumps(result['engine'])}: the replicas hold half
the adapters at most), deployed fresh for each policy, then `shunter bench run {shlex.join(result['workload_options'])}`
(adapters chosen by a Zipf mix). Loads and seconds come from the replicas' own counters.

{lora_table(result['rows'])}

{chr(10).join(ratios)}

An adapter took {cost['adapter_load_s'] * 1000:.0f} ms to load on average; the engine prefills
{cost['prefill_tokens_per_s']:.0f} prompt tokens/s: a load costs about {cost['adapter_load_tokens']} prompt
tokens of prefill (`routing.adapter_load_tokens`). A request decoded in {cost.get('decode_s', 0) * 1000:.0f} ms
(E2E p50 - TTFT p50, mean over the policies): waiting for another adapter's requests to leave the batch
costs about half that, {cost.get('adapter_busy_tokens', 0)} prompt tokens (`routing.adapter_busy_tokens`).
"""


def _ratio(worse: float | None, better: float | None) -> str:
    return "n/a" if not worse or not better else f"{worse / better:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shunter bench lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--adapters", type=int, default=ADAPTERS, help="LoRA adapters to make and serve")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of: {', '.join(POLICIES)}")
    parser.add_argument("--out", type=Path, default=Path("results/lora.json"))
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    if args.adapters < 1:
        parser.error("--adapters must be at least 1")
    from shunter.bench.runner import environment

    result = compare_lora(args.config, args.model, policies, args.adapters)
    print("\n" + lora_section(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "lora", **result, **environment()}, indent=1))
    print(f"written to {args.out}")
    return 0
