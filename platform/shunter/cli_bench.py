"""`shunter bench overhead`: the same chat prompts through Shunter and through vLLM alone.

Three sides, each the same model with the same engine settings on the same cores (every core of this
machine), each request generating exactly `max_tokens` tokens (`ignore_eos`), the prompts the same chat
messages rendered by the model's own chat template:
- `vllm-alone`: vLLM's AsyncLLM in this process, no HTTP at all (the engine's ceiling);
- `vllm-server`: vLLM's own OpenAI server, driven by the same streaming client as Shunter (what HTTP,
  SSE and the OpenAI layer cost);
- `shunter`: the Shunter app serving only that model (what Ray Serve, the gateway and the replica add).

    shunter bench overhead [--config configs/local.yaml] [--model NAME] [--concurrency 1,8,32]

This is the first of the standard benchmarks (`make bench`); it reports, it does not assert.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple words.", "Write a haiku about rain.",
    "Why is the sky blue?", "Give three tips for learning to cook.", "What does a compiler do?",
    "Describe a cat to someone who has never seen one.", "How do airplanes stay in the air?",
]


@dataclass
class RunResult:
    side: str
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    ttft_mean_s: float
    ttft_p50_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


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
                                max_tokens: int) -> list[RunResult]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)

    async def one(i: int) -> tuple[int, float]:
        start, ttft, tokens = time.perf_counter(), None, 0
        stream = await client.chat.completions.create(
            model=model, messages=_messages(i), max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return tokens, ttft or 0.0

    try:
        await _drive("warmup", one, 4, 4)
        return [await _drive(side, one, c, _requests_for(c)) for c in levels]
    finally:
        await client.close()


def vllm_server(model_path: str, served_name: str, engine_cfg: Any) -> tuple[subprocess.Popen, str]:
    """vLLM's own OpenAI server (the reference peers compare against), same settings and cores."""
    import os

    import httpx

    from shunter.cpu_cores import node_cores
    from shunter.engine import EngineSpec, cpu_engine_env

    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = EngineSpec(served_name, model_path, "generate", engine_cfg, "cpu").engine_args()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", args["dtype"], "--max-model-len", str(args["max_model_len"]),
           "--max-num-seqs", str(args["max_num_seqs"]), "--disable-uvicorn-access-log"]
    cmd += ["--enforce-eager"] if args["enforce_eager"] else []
    env = {**os.environ, **cpu_engine_env(engine_cfg.cpu_kv_cache_gib, ",".join(map(str, node_cores())))}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(2)
    proc.kill()
    raise RuntimeError("vLLM's server did not come up within 300 s")


def _requests_for(concurrency: int) -> int:
    return max(8, concurrency * 2)


def _serve_single_model(args_cfg: Any, model_name: str) -> tuple[str, Any]:
    """Serve only `model_name` from the config (so it owns every core, like vLLM alone), return its URL."""
    import ray
    from ray import serve

    from deployments.app import assemble
    from shunter.config import ShunterConfig

    cfg = ShunterConfig.model_validate({**args_cfg.model_dump(), "models": [
        m.model_dump() for m in args_cfg.models if m.name == model_name]})
    ray.init(include_dashboard=False, log_to_driver=False)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(assemble(cfg), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}", cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shunter bench overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results/overhead.json"))
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    from shunter.catalog import resolve_source
    from shunter.cli import load_app_configs

    (_, cfg), *_ = load_app_configs(args.config)
    model = cfg.find_model(args.model)
    if model is None or model.task != "generate":
        raise SystemExit(f"{args.model!r} is not a generate model of {args.config}")
    path = resolve_source(model.source, cfg.model_cache_dir)

    alone = asyncio.run(bench_vllm_alone(path, model.engine, levels, args.max_tokens))
    proc, server_url = vllm_server(path, model.name, model.engine)
    try:
        server = asyncio.run(bench_openai_endpoint("vllm-server", server_url, model.name, levels, args.max_tokens))
    finally:
        proc.terminate()
        proc.wait(60)
    base_url, _ = _serve_single_model(cfg, model.name)
    try:
        through = asyncio.run(bench_openai_endpoint("shunter", base_url, model.name, levels, args.max_tokens))
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()

    rows = []
    print("\noutput tokens/s (TTFT p50) and Shunter's throughput relative to each reference")
    print(f"{'concurrency':>11} {'AsyncLLM alone':>20} {'vLLM OpenAI server':>20} {'Shunter':>20} "
          f"{'vs alone':>9} {'vs server':>10}")
    for a, v, g in zip(alone, server, through, strict=True):
        cells = [f"{r.tokens_per_s:7.1f} ({r.ttft_p50_s * 1000:5.0f} ms)" for r in (a, v, g)]
        print(f"{a.concurrency:>11} {cells[0]:>20} {cells[1]:>20} {cells[2]:>20} "
              f"{g.tokens_per_s / a.tokens_per_s:>9.2f} {g.tokens_per_s / v.tokens_per_s:>10.2f}")
        rows.append({"concurrency": a.concurrency,
                     **{r.side: {**asdict(r), "tokens_per_s": r.tokens_per_s} for r in (a, v, g)},
                     "shunter_vs_alone": g.tokens_per_s / a.tokens_per_s,
                     "shunter_vs_vllm_server": g.tokens_per_s / v.tokens_per_s})
    from shunter.bench.runner import environment

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "overhead", "model": model.name, "max_tokens": args.max_tokens,
                                    "results": rows, **environment()}, indent=2))
    print(f"\nwritten to {args.out}")
    return 0

