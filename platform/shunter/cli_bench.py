"""`shunter bench overhead`: the same chat prompts through the Shunter gateway and through vLLM alone.

Both sides run the same model with the same engine settings on the same cores (every core of this
machine), each request generates exactly `max_tokens` tokens (`ignore_eos`), and the prompts are the
same chat messages rendered by the model's own chat template. What differs is everything Shunter adds:
HTTP, the gateway, the Ray Serve handle, the replica and vLLM's OpenAI layer.

    shunter bench overhead [--config configs/local.yaml] [--model NAME] [--concurrency 1,8,32]

This is the first of the standard benchmarks (`make bench`); it reports, it does not assert.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
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


async def bench_gateway(base_url: str, model: str, levels: list[int], max_tokens: int) -> list[RunResult]:
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
        return [await _drive("gateway", one, c, _requests_for(c)) for c in levels]
    finally:
        await client.close()


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
    base_url, _ = _serve_single_model(cfg, model.name)
    try:
        through = asyncio.run(bench_gateway(base_url, model.name, levels, args.max_tokens))
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()

    rows = []
    print(f"\n{'concurrency':>11} {'vLLM alone tok/s':>17} {'gateway tok/s':>14} {'ratio':>6} "
          f"{'TTFT p50 alone':>15} {'TTFT p50 gateway':>17}")
    for a, g in zip(alone, through, strict=True):
        ratio = g.tokens_per_s / a.tokens_per_s
        print(f"{a.concurrency:>11} {a.tokens_per_s:>17.1f} {g.tokens_per_s:>14.1f} {ratio:>6.2f} "
              f"{a.ttft_p50_s * 1000:>13.0f}ms {g.ttft_p50_s * 1000:>15.0f}ms")
        rows.append({"vllm_alone": {**asdict(a), "tokens_per_s": a.tokens_per_s},
                     "gateway": {**asdict(g), "tokens_per_s": g.tokens_per_s}, "throughput_ratio": ratio})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "overhead", "model": model.name, "max_tokens": args.max_tokens, "results": rows,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": _commit(),
        "machine": {"cpus": len(__import__("os").sched_getaffinity(0)), "platform": platform.platform()},
    }, indent=2))
    print(f"\nwritten to {args.out}")
    return 0


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
