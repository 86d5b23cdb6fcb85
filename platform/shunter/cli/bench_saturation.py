"""`shunter bench saturation`: a burst far past what the engine runs at once, against vLLM's own server
and Shunter, on the same engine settings and cores.

Every stream of the burst starts at once and asks for `--max-tokens` tokens (`ignore_eos`). vLLM's own
server queues everything; Shunter admits up to its bound and refuses the rest (429/503). What an
overloaded platform owes its clients, and what this reports per side: refusals answered at once
(refusal latency p50/p99 to the response's status line, from the client's call and from the request's
last byte written: the client's own queue is not the platform's; and p99 of when each request was
written), admitted streams served (admitted TTFT p50/p99), the burst's wall time and output tokens/s, and the serving side's CPU per 1,000 tokens
(shunter.bench.cpu).

    shunter bench saturation [--streams 256] [--replicas 1]     # one replica on every core
    shunter bench saturation --streams 400 --replicas 2 --no-vllm-server  # two one-core replicas
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from shunter.cli.app_files import generate_model_of
from shunter.cli.bench_peers import QUESTIONS, vllm_server
from shunter.local_serve import local_serve


def _quantile(values: list[float], q: float) -> float | None:
    """shunter.bench.stats.percentile (q in [0, 1] here), None for no values (no refusals, say)."""
    from shunter.bench.stats import percentile

    return percentile(values, q * 100) if values else None


async def burst(side: str, base_url: str, model: str, streams: int, max_tokens: int) -> dict[str, Any]:
    from shunter.bench.cpu import CpuMeter
    from shunter.bench.loadgen import LoadConfig, run_load
    from shunter.bench.workloads import Session, Turn

    sessions = [Session(i, [Turn(QUESTIONS[i % len(QUESTIONS)], 0, max_tokens)]) for i in range(streams)]
    cfg = LoadConfig(base_url=f"{base_url}/v1", model=model, concurrency=streams, max_requests=streams,
                     progress=False, timeout_s=900)
    meter = CpuMeter()
    meter.start()
    records, wall = await run_load(sessions, cfg)
    cpu = meter.stop()
    served = [r for r in records if r.ok]
    refused = [r for r in records if r.status in (429, 503)]
    tokens = sum(r.output_tokens for r in served)
    ttfts = [r.ttft_s for r in served if r.ttft_s is not None]
    refusals = [r.head_s for r in refused if r.head_s is not None]
    # From the request's last byte on the wire: the platform's part, without the client's own queue.
    from_wire = [r.head_s - r.written_s for r in refused if r.head_s is not None and r.written_s is not None]
    return {
        "side": side, "streams": streams, "served": len(served), "refused": len(refused),
        "failed": len(records) - len(served) - len(refused),
        "errors": sorted({r.error for r in records if not r.ok and r.status not in (429, 503) and r.error})[:3],
        "wall_s": wall, "output_tokens_per_s": tokens / wall if wall else 0.0,
        "ttft_p50_s": _quantile(ttfts, 0.5), "ttft_p99_s": _quantile(ttfts, 0.99),
        "refusal_p50_s": _quantile(refusals, 0.5), "refusal_p99_s": _quantile(refusals, 0.99),
        "refusal_wire_p50_s": _quantile(from_wire, 0.5), "refusal_wire_p99_s": _quantile(from_wire, 0.99),
        "written_p99_s": _quantile([r.written_s for r in records if r.written_s is not None], 0.99),
        "serving_cpu_ms_per_1k": cpu.per_1k_tokens(tokens), "serving_cpu_top": cpu.top,
    }


def measure(config: Path, model_name: str, streams: int, replicas: int, max_tokens: int,
            with_vllm_server: bool) -> list[dict[str, Any]]:
    from shunter.config import ShunterConfig
    from shunter.deployments.app import assemble

    cfg, model, path = generate_model_of(config, model_name)
    rows = []
    if with_vllm_server:
        proc, url = vllm_server(path, model.name, model.engine)
        try:
            asyncio.run(burst("warmup", url, model.name, 4, 4))
            rows.append(asyncio.run(burst("vllm-server", url, model.name, streams, max_tokens)))
        finally:
            proc.terminate()
            proc.wait(60)
    served = {**model.model_dump(), "replicas": replicas, "autoscaling": None,
              "cpu_cores_per_replica": "auto"}
    app = assemble(ShunterConfig.model_validate({**cfg.model_dump(), "models": [served]}))
    with local_serve() as local:
        local.deploy(app, "saturation")
        asyncio.run(burst("warmup", local.base_url, model.name, 4, 4))
        rows.append(asyncio.run(burst(f"shunter-{replicas}x", local.base_url, model.name, streams, max_tokens)))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = ["| side | streams | served | refused | wall s | output tok/s | TTFT p50 / p99 ms | refusal p50 / p99 ms "
             "| from the wire p50 / p99 ms | last written ms | serving CPU ms per 1k tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['side']} | {r['streams']} | {r['served']} | {r['refused']} | {r['wall_s']:.1f} | "
                     f"{r['output_tokens_per_s']:.0f} | {ms(r['ttft_p50_s'])} / {ms(r['ttft_p99_s'])} | "
                     f"{ms(r['refusal_p50_s'])} / {ms(r['refusal_p99_s'])} | "
                     f"{ms(r.get('refusal_wire_p50_s'))} / {ms(r.get('refusal_wire_p99_s'))} | "
                     f"{ms(r.get('written_p99_s'))} | {r['serving_cpu_ms_per_1k']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shunter bench saturation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-vllm-server", dest="vllm_server", action="store_false")
    parser.add_argument("--out", type=Path, default=None, help="default: results/saturation-<streams>.json")
    args = parser.parse_args(argv)
    from shunter.bench.runner import environment

    rows = measure(args.config, args.model, args.streams, args.replicas, args.max_tokens, args.vllm_server)
    print("\n" + table(rows))
    for row in rows:
        if row["errors"]:
            print(f"{row['side']}: other failures: {row['errors']}")
    out = args.out or Path(f"results/saturation-{args.streams}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "saturation", "rows": rows, **environment()}, indent=1))
    print(f"\nwritten to {out}")
    return 0
