"""`shunter bench contention --batch`: what a batch (OpenAI's Batch API) costs the interactive traffic
beside it, and what it gets on an idle model. One Shunter app (the model on one replica with every core,
engine `scheduling_policy: priority`, the built-in priority classes), one run:

1. warmup;
2. *light alone*: a light tenant (class interactive) sends a streamed 16-token chat every 2 s;
3. *light beside a batch*: a `--lines`-line batch (2,000 by default; each line a 16-token chat, `ignore_eos`)
   is submitted by another key; once its lines run, the light tenant sends as in 2 for the same time; then
   the batch is cancelled (its lines run in the least urgent class, at most `batch.max_lines_in_flight_per_key`
   at once);
4. *the batch on the idle model*: a `--idle-lines`-line batch of the same requests alone, timed from its
   first finished line to its last;
5. *`shunter bench run` at the same concurrency*: the same requests from a closed loop of as many streams as
   the batch's lines run at once (the per-key cap), through the same key and class (so the same share of the
   model), timed the same way.

The goals (issue 42): the light tenant's TTFT p99 beside the batch within 1.2x of its TTFT p99 alone, and the
batch's tokens/s on the idle model at least 0.9 of the closed loop's. Results: results/contention-batch.json.

    shunter bench contention --batch [--lines 2000] [--idle-lines 400] [--light-s 60] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from shunter.cli.bench_contention import (
    SIDES,
    TENANTS,
    Client,
    Durations,
    Shot,
    Workload,
    light_schedule,
    open_loop,
    shunter_config,
    warmup,
)
from shunter.cli.bench_peers import QUESTIONS

BATCH_TENANT = "flood"  # its key sends the batches (and the closed loop of step 5)
PER_KEY = 8  # batch.max_lines_in_flight_per_key: the batch's concurrency, and the closed loop's
POLL_S = 0.25
ENDED = ("completed", "failed", "expired", "cancelled")


def batch_lines(model: str, lines: int, tokens: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (line {i})"}]}}).encode() + b"\n"
        for i in range(lines))


class Batches:
    """The Batch API through the batch tenant's key."""

    def __init__(self, client: Client, key: str):
        self.http, self.headers = client.http, {"Authorization": f"Bearer {key}"}

    async def submit(self, content: bytes) -> str:
        uploaded = await self.http.post("/v1/files", headers=self.headers, files={"file": ("in.jsonl", content)},
                                        data={"purpose": "batch"})
        uploaded.raise_for_status()
        created = await self.http.post("/v1/batches", headers=self.headers, json={
            "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        created.raise_for_status()
        return created.json()["id"]

    async def get(self, batch_id: str) -> dict[str, Any]:
        resp = await self.http.get(f"/v1/batches/{batch_id}", headers=self.headers)
        resp.raise_for_status()
        return resp.json()

    async def until(self, batch_id: str, done_lines: int, timeout_s: float) -> tuple[dict[str, Any], float]:
        """The batch once `done_lines` of its lines finished (or it ended), and when (perf_counter)."""
        deadline = time.perf_counter() + timeout_s
        while True:
            batch = await self.get(batch_id)
            counts = batch["request_counts"]
            if counts["completed"] + counts["failed"] >= done_lines or batch["status"] in ENDED:
                return batch, time.perf_counter()
            if time.perf_counter() > deadline:
                raise RuntimeError(f"batch {batch_id}: {done_lines} lines not done within {timeout_s:g} s: {batch}")
            await asyncio.sleep(POLL_S)

    async def cancel(self, batch_id: str) -> None:
        await self.http.post(f"/v1/batches/{batch_id}/cancel", headers=self.headers, json={})


async def light_phase(client: Client, seconds: float, interval_s: float, tokens: int) -> list[Shot]:
    shots: list[Shot] = []
    arrivals = [(t, "light", "interactive", tokens) for t in light_schedule(0.0, seconds, interval_s)]
    await asyncio.gather(*open_loop(client, arrivals, time.perf_counter(), shots, 180))
    return shots


async def closed_loop(client: Client, model: str, requests: int, streams: int, tokens: int) -> tuple[int, float]:
    """`requests` whole chats (the batch's lines, sent as interactive requests) from `streams` streams: the
    tokens produced and the seconds from the first answer to the last."""
    key = client.keys[BATCH_TENANT]
    left = list(range(requests))
    firsts: list[float] = []
    tokens_made = 0

    async def stream() -> None:
        nonlocal tokens_made
        while left:
            i = left.pop(0)
            resp = await client.http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
                "model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (line {i})"}]})
            if resp.status_code != 200:  # the class's share full: as the batch's runner, wait and send again
                left.append(i)
                await asyncio.sleep(0.5)
                continue
            firsts.append(time.perf_counter())
            tokens_made += resp.json()["usage"]["completion_tokens"]

    await asyncio.gather(*(stream() for _ in range(streams)))
    return tokens_made, max(firsts) - min(firsts)


async def run(url: str, model: str, keys: dict[str, str], a: argparse.Namespace) -> dict[str, Any]:
    client = Client(url, model, SIDES["shunter-classes"], keys)
    batches = Batches(client, keys[BATCH_TENANT])
    try:
        await warmup(client)
        alone = await light_phase(client, a.light_s, a.light_interval_s, a.light_tokens)
        print(f"  light alone: {len(alone)} requests", flush=True)
        busy = await batches.submit(batch_lines(model, a.lines, a.batch_tokens))
        await batches.until(busy, PER_KEY, 600)  # its lines are running
        beside = await light_phase(client, a.light_s, a.light_interval_s, a.light_tokens)
        during, _ = await batches.until(busy, 0, 60)
        await batches.cancel(busy)
        await batches.until(busy, a.lines, 600)
        print(f"  light beside the batch: {len(beside)} requests; the batch had {during['request_counts']}",
              flush=True)
        idle = await batches.submit(batch_lines(model, a.idle_lines, a.batch_tokens))
        _, first = await batches.until(idle, 1, 600)
        ended, last = await batches.until(idle, a.idle_lines, 3600)
        counts = ended["request_counts"]
        batch_tok_s = (counts["completed"] - 1) * a.batch_tokens / (last - first)
        print(f"  batch on the idle model: {counts}, {batch_tok_s:.1f} tok/s", flush=True)
        loop_tokens, loop_s = await closed_loop(client, model, a.idle_lines, PER_KEY, a.batch_tokens)
        loop_tok_s = (loop_tokens - loop_tokens / a.idle_lines) / loop_s
        print(f"  closed loop of {PER_KEY}: {loop_tok_s:.1f} tok/s", flush=True)
        return {"light_alone": [s.brief() for s in alone], "light_beside_batch": [s.brief() for s in beside],
                "batch_during_light": during["request_counts"], "idle_batch": counts,
                "idle_batch_tok_s": batch_tok_s, "closed_loop_tok_s": loop_tok_s, "concurrency": PER_KEY}
    finally:
        await client.close()


def measure(a: argparse.Namespace) -> dict[str, Any]:
    from shunter.cli.app_files import generate_model_of
    from shunter.cli.bench_routing import tenant_keys
    from shunter.config import ShunterConfig
    from shunter.deployments.app import assemble
    from shunter.local_serve import local_serve

    cfg, model, _ = generate_model_of(a.config, a.model)
    keys, key_files = tenant_keys(len(TENANTS))
    started = time.perf_counter()
    with key_files, tempfile.TemporaryDirectory(prefix="shunter-bench-batch-") as state:
        app_cfg = shunter_config(cfg, model, SIDES["shunter-classes"], Path(key_files.name), Workload(), False)
        app_cfg = ShunterConfig.model_validate({**app_cfg.model_dump(mode="json"), "batch": {
            "state": f"{state}/batch.sqlite3", "files": f"{state}/files", "max_lines_in_flight_per_key": PER_KEY}})
        with local_serve() as local:
            local.deploy(assemble(app_cfg), "contention-batch")
            row = asyncio.run(run(local.base_url, model.name, dict(zip(TENANTS, keys, strict=True)), a))
    return {"model": model.name, "engine": model.engine.model_dump(mode="json"), **row,
            "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "wall_s": time.perf_counter() - started}


def report(result: dict[str, Any]) -> str:
    from shunter.cli.bench_contention_report import machine_line, quantile

    def ttft(rows: list[dict[str, Any]], q: float) -> float | None:
        values = [r["first_s"] - r["sent_s"] for r in rows if r["status"] == 200 and r["first_s"] is not None]
        return quantile(values, q * 100)

    alone, beside = result["light_alone"], result["light_beside_batch"]
    p99_alone, p99_beside = ttft(alone, 0.99), ttft(beside, 0.99)
    ratio = p99_beside / p99_alone if p99_alone and p99_beside else None
    throughput = result["idle_batch_tok_s"] / result["closed_loop_tok_s"] if result["closed_loop_tok_s"] else None

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:,.0f}"

    lines = [
        machine_line(result), "",
        "| light tenant (interactive), 16-token chats every 2 s | answered | TTFT p50 ms | TTFT p99 ms |",
        "| --- | --- | --- | --- |",
        f"| alone | {sum(r['status'] == 200 for r in alone)}/{len(alone)} | {ms(ttft(alone, 0.5))} | {ms(p99_alone)} |",
        f"| beside a {result['options']['lines']}-line batch | {sum(r['status'] == 200 for r in beside)}/{len(beside)} "
        f"| {ms(ttft(beside, 0.5))} | {ms(p99_beside)} |", "",
        f"TTFT p99 beside the batch / alone: {ratio:.2f}x (goal <= 1.2x)" if ratio else "TTFT p99: no data", "",
        f"| {result['concurrency']} at once, on the idle model | tokens/s |", "| --- | --- |",
        f"| the batch ({result['idle_batch']['completed']} lines) | {result['idle_batch_tok_s']:.1f} |",
        f"| the same requests from a closed loop (bench run) | {result['closed_loop_tok_s']:.1f} |", "",
        f"batch / closed loop: {throughput:.2f} (goal >= 0.9)" if throughput else "throughput: no data",
    ]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shunter bench contention --batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--lines", type=int, default=2000, help="the batch beside the light tenant")
    p.add_argument("--idle-lines", type=int, default=400, help="the batch on the idle model")
    p.add_argument("--batch-tokens", type=int, default=16, help="tokens each batch line makes")
    p.add_argument("--light-s", type=float, default=Durations().light_alone_s, help="each light phase, s")
    p.add_argument("--light-interval-s", type=float, default=Durations().light_interval_s)
    p.add_argument("--light-tokens", type=int, default=Workload().light_tokens)
    p.add_argument("--quick", action="store_true", help="a smoke test: small batches, short phases")
    p.add_argument("--out", type=Path, default=Path("results/contention-batch.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.quick:
        a.lines, a.idle_lines, a.light_s = min(a.lines, 200), min(a.idle_lines, 40), min(a.light_s, 10.0)
    from shunter.bench.runner import environment
    from shunter.cli.bench_contention_report import cpu_info

    result = {"benchmark": "contention-batch", **measure(a), **environment(), "cpu": cpu_info()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print("\n" + report(result))
    print(f"\nwritten to {a.out} ({result['wall_s']:.0f} s)")
    return 0
