"""`shunter bench run` and `shunter bench compare`: one measured run to a JSON file, runs side by side.

A result file holds everything needed to trust and repeat it: the label, date, commit and machine, the
exact options, the workload's counts, the summary, and every request's own record.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_TOKENIZER = "builtin:smollm2-135m-instruct"


def environment() -> dict[str, Any]:
    """Date, commit and machine: what a benchmark figure is only meaningful with."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
        commit += "-dirty" if dirty else ""  # measured code that is not in the commit
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = None
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": commit,
        "machine": {"cpus": len(os.sched_getaffinity(0)), "memory_gib": round(mem_gib, 1) if mem_gib else None,
                    "platform": platform.platform(), "python": platform.python_version()},
    }


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shunter bench run",
                                description="Measure an OpenAI-compatible endpoint with a seeded workload.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="endpoint root, including /v1")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--endpoint", choices=["chat", "completions", "responses", "messages"], default="chat")
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                   help="model dir, hub id or builtin:NAME whose tokenizer measures lengths")
    p.add_argument("--workload", choices=["random", "shared-prefix", "multi-turn", "adapters", "kv-pressure"],
                   default="random")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="sessions in flight at once (default 8)")
    load.add_argument("--rate", type=float, help="sessions started per second, Poisson arrivals (a session's "
                      "later turns follow its answers; single-turn workloads: requests per second)")
    p.add_argument("--burst", type=int, default=1,
                   help="with --rate: sessions started together at each arrival (the rate stays sessions a "
                   "second); kv-pressure: the sessions of a burst share a group")
    p.add_argument("--requests", type=int, help="stop after this many requests")
    p.add_argument("--duration", type=float, help="stop starting requests after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", default="uniform:64:256", help="random: prompt tokens")
    p.add_argument("--output-len", default="uniform:16:64", help="output tokens (every workload)")
    p.add_argument("--groups", type=int, default=4,
                   help="shared-prefix, kv-pressure: groups (distinct system prompts)")
    p.add_argument("--users", type=int, default=8, help="shared-prefix: users per group")
    p.add_argument("--system-len", type=int, default=1024, help="shared-prefix, kv-pressure: system prompt tokens")
    p.add_argument("--question-len", default="uniform:16:32", help="shared-prefix: question tokens")
    p.add_argument("--conversations", type=int, default=8,
                   help="multi-turn, kv-pressure: conversations (sessions)")
    p.add_argument("--turns", type=int, default=4, help="multi-turn, kv-pressure: turns per conversation")
    p.add_argument("--turn-len", default="uniform:16:64", help="multi-turn, kv-pressure: user tokens per turn")
    p.add_argument("--adapters", default="", help="adapters: comma-separated LoRA adapter names, most asked first")
    p.add_argument("--zipf", type=float, default=1.1,
                   help="adapters, kv-pressure: the Zipf exponent of the adapters' (groups') popularity")
    p.add_argument("--slo-ttft-ms", type=float, help="goodput: a request must start within this")
    p.add_argument("--slo-itl-ms", type=float, help="goodput: ... and average at most this between tokens")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send vLLM's ignore_eos (outputs may then end before --output-len)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--label", help="name of this run in comparisons (default: workload and load)")
    p.add_argument("--out", type=Path, default=Path("results/bench.json"))
    p.add_argument("--plot", type=Path, help="latency CDF PNG (default: next to --out)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def build_sessions(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    from shunter.bench.workloads import (
        LengthDist,
        TextMaker,
        adapter_workload,
        describe,
        kv_pressure_sizing,
        kv_pressure_workload,
        multi_turn_workload,
        random_workload,
        shared_prefix_workload,
    )

    maker = TextMaker(load_tokenizer(args.tokenizer))
    output_len = LengthDist.parse(args.output_len)
    params: dict[str, Any] = {"kind": args.workload, "seed": args.seed, "output_len": str(output_len)}
    if args.workload in ("random", "adapters"):
        input_len = LengthDist.parse(args.input_len)
        count = args.requests or (256 if args.duration else 64)  # a duration-bound run cycles through these
        params["input_len"] = str(input_len)
        if args.workload == "random":
            sessions = random_workload(maker, count, input_len, output_len, args.seed)
        else:
            adapters = [a for a in args.adapters.split(",") if a]
            sessions = adapter_workload(maker, adapters, count, args.zipf, input_len, output_len, args.seed)
            params.update(adapters=adapters, zipf=args.zipf)
    elif args.workload == "shared-prefix":
        question_len = LengthDist.parse(args.question_len)
        sessions = shared_prefix_workload(maker, args.groups, args.users, args.system_len, question_len, output_len,
                                          args.seed)
        params.update(groups=args.groups, users=args.users, system_len=args.system_len,
                      question_len=str(question_len))
    elif args.workload == "kv-pressure":
        turn_len = LengthDist.parse(args.turn_len)
        sessions = kv_pressure_workload(maker, args.groups, args.conversations, args.turns, args.system_len, turn_len,
                                        output_len, args.zipf, args.seed, fan_out=args.burst)
        params.update(burst=args.burst, conversations=args.conversations, turns=args.turns, system_len=args.system_len,
                      turn_len=str(turn_len), zipf=args.zipf, **kv_pressure_sizing(sessions))  # groups: those drawn
    else:
        turn_len = LengthDist.parse(args.turn_len)
        sessions = multi_turn_workload(maker, args.conversations, args.turns, turn_len, output_len, args.seed)
        params.update(conversations=args.conversations, turns=args.turns, turn_len=str(turn_len))
    return sessions, {**params, **describe(sessions)}


def load_tokenizer(spec: str) -> Any:
    from transformers import AutoTokenizer

    from shunter.catalog import resolve_source

    return AutoTokenizer.from_pretrained(resolve_source(spec, progress=False))


def run(args: argparse.Namespace, on_send: Any = None, tenant_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """One measured run; `on_send(index, body)` sees each request just before it is sent; `tenant_keys`:
    the sessions' keys, spread over their users (shunter.bench.loadgen.LoadConfig)."""
    from shunter.bench.loadgen import LoadConfig, run_load
    from shunter.bench.stats import summarize

    concurrency = None if args.rate is not None else (args.concurrency or 8)
    sessions, workload = build_sessions(args)
    # Without a count or a duration, a run is one pass over the workload.
    one_pass = not (args.requests or args.duration)
    max_requests = workload["requests"] if one_pass else args.requests
    cfg = LoadConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint, concurrency=concurrency,
                     rate=args.rate, max_requests=max_requests, duration_s=args.duration,
                     ignore_eos=args.ignore_eos, seed=args.seed, api_key=args.api_key, progress=not args.quiet,
                     on_send=on_send, one_pass=one_pass, burst=args.burst, tenant_keys=tenant_keys)
    records, wall = asyncio.run(run_load(sessions, cfg))
    load = f"c{concurrency}" if concurrency else f"rate{args.rate:g}" + (f"x{args.burst}" if args.burst > 1 else "")
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"}
    return {
        "label": args.label or f"{args.workload}-{load}",
        **environment(),
        "options": options,
        "workload": workload,
        "summary": summarize(records, wall, _ms_to_s(args.slo_ttft_ms), _ms_to_s(args.slo_itl_ms)),
        "requests": [r.to_json() for r in records],
    }


def _ms_to_s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def main_run(argv: list[str]) -> int:
    parser = run_parser()
    args = parser.parse_args(argv)
    if args.burst < 1 or (args.burst > 1 and args.rate is None):
        parser.error("--burst is at least 1, and more only with --rate (sessions arriving together)")
    if args.rate is not None and not args.rate > 0:
        parser.error("--rate must be positive")
    result = run(args)
    plot = args.plot or args.out.with_suffix(".png")
    write_result(result, args.out, plot)
    from shunter.bench.compare import compare_table

    print(compare_table([result]))
    print(f"\nwritten: {args.out} and {plot}")
    return 0 if result["summary"]["succeeded"] else 1


def write_result(result: dict[str, Any], out: Path, plot: Path | None) -> None:
    from shunter.bench.plots import plot_latency_cdfs

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if plot is not None:
        plot_latency_cdfs(result, plot, title=result["label"])


def main_compare(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="shunter bench compare", description="Runs side by side, with ratios.")
    p.add_argument("results", nargs="+", type=Path, help="result JSON files from `shunter bench run`")
    p.add_argument("--plot", type=Path, default=Path("results/compare.png"))
    args = p.parse_args(argv)
    from shunter.bench.compare import compare_table
    from shunter.bench.plots import plot_comparison

    results = [json.loads(path.read_text()) for path in args.results]
    print(compare_table(results))
    plot_comparison(results, args.plot)
    print(f"\nplot: {args.plot}")
    return 0
