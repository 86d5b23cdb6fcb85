"""`shunter bench agents`: chat, the Responses API and Anthropic's Messages API, each through Shunter and
through vLLM's own OpenAI server (which serves all three from one process), the same model and engine
settings on the same cores, driven by the same streaming client. Ray Serve LLM is not a side here: Ray
2.60's LLM app serves neither the Responses nor the Messages API.

    shunter bench agents [--config configs/local.yaml] [--model NAME] [--concurrency 1,8]

The agent APIs stream typed events that the gateway reads one by one (for their usage and timing),
where a chat stream's chunks pass on a fast path; the chat rows, measured in the same run, are the
reference for what that costs. Benchmarks report; they never assert.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from shunter.cli.app_files import generate_model_of
from shunter.cli.bench_overhead import _single_model_app, bench_openai_endpoint
from shunter.cli.bench_peers import vllm_server
from shunter.local_serve import local_serve

ENDPOINTS = ("chat", "responses", "messages")


def measure(config: Path, model_name: str, levels: list[int], max_tokens: int) -> list[dict[str, Any]]:
    cfg, model, path = generate_model_of(config, model_name)
    proc, server_url = vllm_server(path, model.name, model.engine)
    try:
        server = {e: asyncio.run(bench_openai_endpoint("vllm-server", server_url, model.name, levels, max_tokens, e))
                  for e in ENDPOINTS}
    finally:
        proc.terminate()
        proc.wait(60)
    with local_serve() as local:
        local.deploy(_single_model_app(cfg, model.name), "bench")
        through = {e: asyncio.run(bench_openai_endpoint("shunter", local.base_url, model.name, levels, max_tokens, e))
                   for e in ENDPOINTS}
    rows = []
    for endpoint in ENDPOINTS:
        for v, s in zip(server[endpoint], through[endpoint], strict=True):
            rows.append({"endpoint": endpoint, "concurrency": v.concurrency,
                         "vllm_server": {"tokens_per_s": v.tokens_per_s, "ttft_p50_s": v.ttft_p50_s,
                                         "output_tokens": v.output_tokens},
                         "shunter": {"tokens_per_s": s.tokens_per_s, "ttft_p50_s": s.ttft_p50_s,
                                     "output_tokens": s.output_tokens},
                         "shunter_vs_vllm_server": s.tokens_per_s / v.tokens_per_s,
                         "ttft_p50_overhead_ms": (s.ttft_p50_s - v.ttft_p50_s) * 1000})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| API | streams | vLLM server tok/s (TTFT p50) | Shunter tok/s (TTFT p50) | Shunter / vLLM server "
             "| TTFT p50 over vLLM server |", "|---|---|---|---|---|---|"]
    for row in rows:
        v, s = row["vllm_server"], row["shunter"]
        lines.append(f"| {row['endpoint']} | {row['concurrency']} | {v['tokens_per_s']:.1f} ({v['ttft_p50_s'] * 1000:.0f} ms) "
                     f"| {s['tokens_per_s']:.1f} ({s['ttft_p50_s'] * 1000:.0f} ms) | {row['shunter_vs_vllm_server']:.2f} "
                     f"| {row['ttft_p50_overhead_ms']:+.0f} ms |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shunter bench agents", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results/agents.json"))
    args = parser.parse_args(argv)
    from shunter.bench.runner import environment

    rows = measure(args.config, args.model, [int(c) for c in args.concurrency.split(",")], args.max_tokens)
    print("\noutput tokens/s (TTFT p50)\n" + table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "agents", "rows": rows, **environment()}, indent=2))
    print(f"\nwritten to {args.out}")
    return 0
