"""`shunter bench routing`: routing policies side by side on 2 replicas, on the shared-prefix workload or
under KV-cache pressure.

For each policy the same model is deployed fresh (cold KV caches, new gateway, new router), driven by
the same seeded workload, and measured from both ends: the client's TTFT, end-to-end latency and
throughput, and the engines' own prefix-cache counters (prompt tokens looked up and found cached), read
from each replica by a pinned call before and after the run. Each run's exact prompts are also replayed
through an oracle that knows every replica's cache (`shunter.bench.kv_oracle`): the ceiling of the hit rate.

Workloads (`--workload`):
- `shared-prefix` (default): 16 long system prompts x 4 users; the prompts of one group fit any replica's
  cache, so what separates the policies is whether a group's requests meet the replica that prefilled it;
- `kv-pressure`: 12 groups of Zipf-skewed popularity and 64 two-turn sessions whose history grows, on
  engines with a small KV cache (92 blocks of 128 tokens each): the distinct prompt blocks are about 2.3x one
  replica's capacity, so replicas evict, and a router must know what each one still holds. Sessions start
  at Poisson times (1 a second); `--scale-out` starts each policy on one replica and lets the queue-depth
  autoscaler add the second under load; `--burst N` starts N sessions of one group at a time.

What the runs report (tables, the goals, docs/benchmarks.md's sections) is `shunter.cli.bench_routing_report`.

Policies: Shunter's `prefix_aware` with the engines' KV events (`precise`) and with its own record of what
it sent (`approximate`), `least_connections`, `power_of_two` (Ray Serve's default) and Ray's own
`PrefixCacheAffinityRouter` (policy `custom`, its default settings).

What tenant isolation costs (`--tenants N`): the app gets N API keys and each session sends with its
user's (user u of a group: key u mod N), so each group's system prompt is asked for by N tenants. Each
policy then runs twice in the same run: `per-key` (the default: every key's prompt cache apart, so each
tenant prefills the prompt once) and `one-group` (all N keys in one `cache_group`: the prompt is shared).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from shunter.cli.bench_routing_report import (
    isolation_section,
    kv_pressure_section,
    pressure_line,
    routing_section,
    routing_table,
)

APP = "bench-routing"
RAY_PREFIX_ROUTER = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
POLICIES: dict[str, dict[str, Any]] = {
    "precise": {"policy": "prefix_aware", "prefix_source": "precise"},
    "approximate": {"policy": "prefix_aware", "prefix_source": "approximate"},
    "least_connections": {"policy": "least_connections"},
    "power_of_two": {"policy": "power_of_two"},
    "ray_prefix_cache_affinity": {"policy": "custom", "router_class": RAY_PREFIX_ROUTER},
}
# 16 system prompts x 4 users: the prompts of one group fit any replica's cache, so what separates the
# policies is whether a group's requests meet the replica that already prefilled its prompt.
WORKLOAD = ["--workload", "shared-prefix", "--groups", "16", "--users", "4", "--system-len", "1024",
            "--question-len", "uniform:16:32", "--output-len", "fixed:32", "--concurrency", "8",
            "--slo-ttft-ms", "2000", "--slo-itl-ms", "150", "--seed", "0"]
# 12 system prompts of 1,536 tokens, Zipf(0.3) popularity; 64 sessions of 2 turns whose history grows by
# 64-128 user tokens and a 16-token answer a turn: about 2.3x a replica's 91 usable blocks (11,648 tokens)
# in distinct prompt blocks, a little more than both replicas hold. Sized so that the prompts about fit the
# two caches split between them but not one cache: a router that keeps each group on one replica hits, one
# that spreads groups makes every cache hold them all, and they thrash. Replayed with stand-in answers
# (shunter.bench.kv_oracle.simulate), the oracle hits about 81% of the prompt tokens, random routing about
# 53%; the longest prompt is about 1.8k tokens, within max_model_len. (A first sizing, 16 groups at Zipf
# 0.5, left less room between the two: oracle 75%, random 48%; see docs/benchmarks.md section 7.)
# Sessions start at Poisson times, 1 a second (2 requests a second), as users arrive, whatever the
# servers' pace: on two one-core engines that is more prefill than a router that misses 40% of the prompt
# can do, and well within one that misses 20%; a fixed number of sessions in flight (closed loop) would
# instead slow the clients down to each router's pace and hide the difference in queueing (a run of it:
# docs/benchmarks.md section 7).
KV_PRESSURE_WORKLOAD = ["--workload", "kv-pressure", "--groups", "12", "--conversations", "64", "--turns", "2",
                        "--system-len", "1536", "--turn-len", "uniform:64:128", "--output-len", "fixed:16",
                        "--zipf", "0.3", "--rate", "1.0", "--slo-ttft-ms", "2000", "--slo-itl-ms", "150",
                        "--seed", "0"]
WORKLOADS = {"shared-prefix": WORKLOAD, "kv-pressure": KV_PRESSURE_WORKLOAD}
# Gateway replicas, each with its own router. Production runs several (one per ingress process, for
# throughput and availability); under KV pressure that is where a router's picture of the caches comes
# apart from the truth: each gateway sees only its own traffic, so two of them spread one group over both
# replicas unless the replicas say what they hold.
GATEWAYS = {"shared-prefix": 1, "kv-pressure": 2}
# A small KV cache. `engine.cpu_kv_cache_gib` takes whole GiB only (1 GiB = 364 blocks of SmolLM2), so the
# engine's block count is set directly (vLLM's num_gpu_blocks_override, which its CPU build honours): 92
# blocks, one of them vLLM's null block, i.e. 91 x 128 = 11,648 tokens, what 0.25 GiB would give.
KV_PRESSURE_BLOCKS = 92
KV_PRESSURE_MAX_MODEL_LEN = 2048


# Scale-out under pressure (`--scale-out`): each policy starts on one replica and the platform's own
# queue-depth autoscaler adds the second once requests queue (the same settings for every policy). Routers
# that pin a prefix to the replica that first took it keep the new replica idle for every prefix seen
# before it came. 192 sessions at 0.9 a second (1.8 requests a second): more than one replica can prefill
# and well within two; the run is long enough (about 210 s) that most of it comes after the second replica
# is up (about a minute in), since until then every router queues alike, and how long that takes varies
# from run to run (two runs of 128 sessions: precise's whole-run TTFT p50 364 ms and 2.4 s). At 0.6 a
# second one replica nearly keeps up and pinning costs little (docs/benchmarks.md section 8).
SCALE_OUT_AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_queue_per_replica": 2,
                         "upscale_delay_s": 5, "downscale_delay_s": 3600}
SCALE_OUT_LOAD = {"rate": 0.9, "conversations": 192}


class ScaleWatch:
    """When a deployment first runs `target` replicas, from Serve's status polled once a second in a thread
    (a scale-out run's timeline: the requests sent before and after the added replica was up)."""

    def __init__(self, app: str, deployment: str, target: int):
        import threading

        self.app, self.deployment, self.target = app, deployment, target
        self.reached_at: float | None = None  # time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="scale-watch", daemon=True)

    def __enter__(self) -> ScaleWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _poll(self) -> None:
        from ray import serve

        while not self._stop.wait(1.0):
            try:
                states = serve.status().applications[self.app].deployments[self.deployment].replica_states
            except Exception:  # noqa: BLE001 - a status call that failed is tried again in a second
                continue
            if states.get("RUNNING", 0) >= self.target:
                self.reached_at = time.perf_counter()
                return


def after_scale_out(requests: list[dict[str, Any]], at_s: float | None) -> dict[str, Any]:
    """The requests a run sent once its added replica was up (`at_s`, seconds into the run): how many,
    their TTFT p50/p90, and each replica's share of them (the replica header's; `unknown` where absent)."""
    from collections import Counter

    from shunter.bench.stats import percentile

    if at_s is None:
        return {"second_replica_at_s": None}
    later = [r for r in requests if r["start_s"] >= at_s and r["ok"] and r["ttft_s"] is not None]
    ttfts = [r["ttft_s"] for r in later]
    per_replica = Counter(r.get("replica") or "unknown" for r in later)
    return {"second_replica_at_s": at_s, "requests": len(later),
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
            "ttft_p90_s": percentile(ttfts, 90) if ttfts else None,
            "shares": sorted(n / len(later) for n in per_replica.values()) if later else []}


def with_load(options: list[str], rate: float | None = None, concurrency: int | None = None,
              burst: int = 1) -> list[str]:
    """A workload's options with its arrivals replaced: Poisson session starts at `rate` a second, or
    `concurrency` sessions in flight (neither: as they are); `burst` sessions (of one group) at a time."""
    if burst > 1:
        options = [*options, "--burst", str(burst)]
    if rate is None and concurrency is None:
        return options
    out, skip = [], False
    for opt in options:
        if skip:
            skip = False
        elif opt in ("--rate", "--concurrency"):
            skip = True
        else:
            out.append(opt)
    return out + (["--rate", f"{rate:g}"] if rate is not None else ["--concurrency", str(concurrency)])


def run_options(workload: str, rate: float | None = None, concurrency: int | None = None, burst: int = 1,
                scale_out: bool = False) -> list[str]:
    """The `shunter bench run` options of one policy's run: the workload's, its arrivals replaced
    (`with_load`); a scale-out run is longer and slower (SCALE_OUT_LOAD) unless arrivals are given."""
    if scale_out and (rate, concurrency) == (None, None):
        rate = SCALE_OUT_LOAD["rate"]
    options = with_load(WORKLOADS[workload], rate, concurrency, burst)
    if scale_out:
        at = options.index("--conversations") + 1
        options = [*options[:at], str(SCALE_OUT_LOAD["conversations"]), *options[at + 1:]]
    return options


def kv_pressure_engine(engine: dict[str, Any], blocks: int = KV_PRESSURE_BLOCKS) -> dict[str, Any]:
    """A model's engine settings (JSON) with a KV cache of `blocks` blocks and a max_model_len that fits."""
    if (blocks - 1) * 128 < KV_PRESSURE_MAX_MODEL_LEN:
        raise ValueError(f"{blocks} KV blocks cannot hold one {KV_PRESSURE_MAX_MODEL_LEN}-token sequence")
    return {**engine, "max_model_len": KV_PRESSURE_MAX_MODEL_LEN,
            "extra_engine_args": {**engine.get("extra_engine_args", {}), "num_gpu_blocks_override": blocks}}


def longest_request_tokens(options: list[str]) -> float:
    """An upper bound of a kv-pressure request's tokens (prompt + answer), chat template included (at most
    8 tokens a message), from the workload's options."""
    from shunter.bench.runner import run_parser
    from shunter.bench.workloads import LengthDist

    args = run_parser().parse_args(options)
    turn, out = LengthDist.parse(args.turn_len).upper, LengthDist.parse(args.output_len).upper
    return args.system_len + 8 + args.turns * (turn + 8) + args.turns * (out + 8)


def replica_ids(handle: Any, expected: int, missing_ok: bool = False) -> list[str]:
    """The ids of a deployment's `expected` running replicas (shared with `shunter bench lora`);
    `missing_ok`: those found, when fewer run (an autoscaler that did not add them)."""
    seen: set[str] = set()
    for _ in range(200):  # unpinned calls spread over idle replicas at random
        seen.add(handle.stats.remote().result(timeout_s=60)["replica"])
        if len(seen) == expected:
            return sorted(seen)
    if missing_ok:
        return sorted(seen)
    raise RuntimeError(f"found only {len(seen)} of {expected} replicas")


def _counters(handle: Any, replicas: list[str]) -> dict[str, dict[str, Any]]:
    from shunter.replica_protocol import RouteHint

    return {r: handle.stats.remote(RouteHint(pin=r)).result(timeout_s=60) for r in replicas}


def kv_capacity(handle: Any, stats: dict[str, dict[str, Any]]) -> tuple[int, int] | None:
    """(KV blocks, block size) of a deployment's replicas, as the engines report them: from their stats
    where those carry `kv_cache_blocks`, else from the routing stats they push (`record_routing_stats`,
    called unpinned a few times: replicas of one deployment share one engine config). The smallest seen."""
    blocks = [s.get("kv_cache_blocks") or 0 for s in stats.values()]
    sizes = [s.get("block_size") or 0 for s in stats.values()]
    if not blocks or not all(blocks):
        try:
            pushed = [handle.record_routing_stats.remote().result(timeout_s=60) for _ in range(4)]
        except Exception as exc:  # noqa: BLE001 - the oracle is then left out, the run still counts
            print(f"could not read the replicas' KV capacity: {exc}", flush=True)
            return None
        blocks = [p.get("kv_cache_blocks") or 0 for p in pushed]
        sizes = [p.get("block_size") or 0 for p in pushed]
    blocks = [b for b in blocks if b]
    if not blocks:
        return None
    return min(blocks), min((b for b in sizes if b), default=128)


def tenant_keys(tenants: int) -> tuple[tuple[str, ...], Any]:
    """`tenants` new API keys, and the folder holding them as key files (a context that removes it)."""
    import tempfile

    from shunter.auth import new_key

    keys = tuple(new_key() for _ in range(tenants))
    folder = tempfile.TemporaryDirectory(prefix="shunter-bench-keys-")
    for i, key in enumerate(keys):
        (Path(folder.name) / f"tenant-{i}").write_text(key + "\n")
    return keys, folder


def compare_routing(config: Path, model_name: str, policies: list[str], replicas: int = 2,
                    workload: str = "shared-prefix", kv_blocks: int = KV_PRESSURE_BLOCKS,
                    gateways: int | None = None, rate: float | None = None,
                    concurrency: int | None = None, burst: int = 1, scale_out: bool = False,
                    tenants: int = 0) -> dict[str, Any]:
    """`gateways`: gateway replicas, each with its own router (default: GATEWAYS[workload]); `rate` /
    `concurrency`: the workload's arrivals instead of its own (`with_load`); `scale_out`: start on one
    replica and let the autoscaler add the rest (SCALE_OUT_AUTOSCALING, `replicas` at most); `tenants`:
    that many API keys, each policy run with per-key prompt caches and with one cache group (module docstring)."""
    from ray import serve
    from transformers import AutoTokenizer

    from shunter.bench.kv_oracle import PromptRecorder, oracle_for_run
    from shunter.bench.runner import run, run_parser
    from shunter.cli.app_files import generate_model_of
    from shunter.config import ShunterConfig
    from shunter.deployments.app import assemble
    from shunter.local_serve import local_serve
    from shunter.serve_plan import deployment_name

    options = run_options(workload, rate, concurrency, burst, scale_out)
    gateways = gateways or GATEWAYS[workload]
    cfg, model, path = generate_model_of(config, model_name)
    engine = model.engine.model_dump(mode="json")
    if workload == "kv-pressure":
        engine = kv_pressure_engine(engine, kv_blocks)
        if longest_request_tokens(options) > engine["max_model_len"]:
            raise SystemExit(f"a kv-pressure request may exceed max_model_len {engine['max_model_len']}")
    tokenizer = AutoTokenizer.from_pretrained(path)  # the oracle tokenizes as the engine does
    rows = []
    started = time.perf_counter()
    keys, key_files = tenant_keys(tenants)
    runs = [(name, group) for name in policies for group in ((None, "org") if tenants else (None,))]
    with local_serve() as local, key_files:
        base = local.base_url
        for policy, group in runs:
            name = policy if not tenants else f"{policy} {'one-group' if group else 'per-key'}"
            spec = {**model.model_dump(mode="json"), "replicas": replicas, "routing": POLICIES[policy],
                    "engine": engine}
            if scale_out:
                spec.update(replicas=1, autoscaling={**SCALE_OUT_AUTOSCALING, "max_replicas": replicas})
            base_cfg = cfg.model_dump(mode="json")
            auth = base_cfg["auth"] if not tenants else {"keys": [
                {"name": f"tenant-{i}", "key_file": str(Path(key_files.name) / f"tenant-{i}"), "cache_group": group}
                for i in range(tenants)]}
            app_cfg = ShunterConfig.model_validate({**base_cfg, "models": [spec], "auth": auth,
                                                    "gateway": {**base_cfg["gateway"], "replicas": gateways}})
            fleet = f"1 replica (autoscaled to {replicas})" if scale_out else f"{replicas} fresh replicas"
            print(f"\n== {name}: deploying {fleet} behind {gateways} gateway(s) "
                  f"({time.perf_counter() - started:.0f} s in)", flush=True)
            local.deploy(assemble(app_cfg), APP)
            handle = serve.get_deployment_handle(deployment_name(app_cfg.models[0]), app_name=APP)
            ids = replica_ids(handle, 1 if scale_out else replicas)
            before = _counters(handle, ids)
            capacity = kv_capacity(handle, before)
            if capacity is None and "num_gpu_blocks_override" in engine.get("extra_engine_args", {}):
                capacity = (engine["extra_engine_args"]["num_gpu_blocks_override"], 128)  # what was asked for
            ran = time.perf_counter()
            recorder = PromptRecorder()
            watch = ScaleWatch(APP, deployment_name(app_cfg.models[0]), replicas) if scale_out else None
            with watch or contextlib.nullcontext():
                result = run(run_parser().parse_args(["--base-url", f"{base}/v1", "--model", model.name, "--quiet",
                                                      "--label", name, *options]), on_send=recorder,
                             tenant_keys=keys)
            scaled = None
            if watch is not None and watch.reached_at is not None:
                # on the load generator's clock: its first request's start_s after its start
                first = recorder.first_sent_at
                load_start = ran if first is None else first - result["requests"][0]["start_s"]
                scaled = watch.reached_at - load_start
            bodies = recorder.in_order()
            ran = time.perf_counter() - ran
            if scale_out:  # the replicas the autoscaler added count from zero
                ids = replica_ids(handle, replicas, missing_ok=True)
                before.update({r: {"prefix_cache_queries": 0, "prefix_cache_hits": 0} for r in ids if r not in before})
            after = _counters(handle, ids)
            queries = {r: after[r]["prefix_cache_queries"] - before[r]["prefix_cache_queries"] for r in ids}
            hits = {r: after[r]["prefix_cache_hits"] - before[r]["prefix_cache_hits"] for r in ids}
            total_q = sum(queries.values())
            oracle = None
            if capacity and not (tenants and group is None):  # the oracle knows no tenants: shared caches only
                try:
                    oracle = oracle_for_run(bodies, result["requests"], tokenizer, replicas, capacity[0],
                                            capacity[1], app_cfg.models[0].routing.max_load_gap)
                except ValueError as exc:  # the run's own figures still count
                    print(f"oracle left out: {exc}", flush=True)
            rows.append({
                "policy": name,
                "routing": POLICIES[policy],
                "tenants": {"keys": tenants, "cache_group": group} if tenants else None,
                "summary": result["summary"],
                "workload": result["workload"],
                "run_s": ran,
                "replicas_at_end": len(ids),
                "after_scale_out": after_scale_out(result["requests"], scaled) if scale_out else None,
                "kv_cache": {"blocks": capacity[0], "block_size": capacity[1]} if capacity else None,
                "engine_prefix_cache": {
                    "queries": total_q, "hits": sum(hits.values()),
                    "hit_rate": sum(hits.values()) / total_q if total_q else 0.0,
                    "prompt_tokens_share_per_replica": sorted((q / total_q if total_q else 0.0)
                                                              for q in queries.values()),
                },
                "oracle": oracle,
                "result": result,
            })
            print(routing_table(rows[-1:]), flush=True)
            print(pressure_line(rows[-1]), flush=True)
            serve.delete(APP)
    return {"model": model.name, "replicas": replicas, "gateways": gateways, "workload": workload,
            "scale_out": {"autoscaling": {**SCALE_OUT_AUTOSCALING, "max_replicas": replicas}} if scale_out else None,
            "workload_options": options,
            "engine": engine, "wall_s": time.perf_counter() - started, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shunter bench routing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="shared-prefix",
                        help="shared-prefix: groups that fit any cache; kv-pressure: distinct prompt tokens about "
                        "2.3x a replica's (small) KV cache, Zipf-skewed groups, multi-turn sessions")
    parser.add_argument("--kv-blocks", type=int, default=KV_PRESSURE_BLOCKS,
                        help="kv-pressure: KV blocks per replica (vLLM num_gpu_blocks_override; one is vLLM's "
                        "null block, each holds 128 tokens)")
    parser.add_argument("--gateways", type=int, default=None,
                        help="gateway replicas, each with its own router (default: 1 for shared-prefix, 2 for "
                        "kv-pressure)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="sessions started a second, Poisson arrivals (default: the "
                      "workload's: 1 for kv-pressure; shared-prefix runs 8 sessions in flight)")
    load.add_argument("--concurrency", type=int, help="sessions in flight at once instead (closed loop)")
    parser.add_argument("--burst", type=int, default=1, help="kv-pressure: sessions of one group that arrive "
                        "together (an agent's parallel calls); the rate stays sessions a second")
    parser.add_argument("--scale-out", action="store_true",
                        help="kv-pressure: start each policy on one replica; the queue-depth autoscaler adds the "
                        "second under load (192 sessions at 0.9 a second unless --rate/--concurrency)")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of: {', '.join(POLICIES)}")
    parser.add_argument("--tenants", type=int, default=0,
                        help="what tenant isolation costs: N API keys, each policy run with per-key prompt caches "
                        "and with the N keys in one cache group (try --policies precise --tenants 4)")
    parser.add_argument("--out", type=Path,
                        help="result JSON (default results/routing.json, results/routing-kv-pressure.json)")
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    if (args.kv_blocks - 1) * 128 < KV_PRESSURE_MAX_MODEL_LEN:
        parser.error(f"--kv-blocks must hold one {KV_PRESSURE_MAX_MODEL_LEN}-token sequence: at least "
                     f"{KV_PRESSURE_MAX_MODEL_LEN // 128 + 1}")
    from shunter.bench.runner import environment

    if args.gateways is not None and args.gateways < 1:
        parser.error("--gateways must be at least 1")
    if (args.rate is not None and not args.rate > 0) or (args.concurrency is not None and args.concurrency < 1):
        parser.error("--rate must be positive and --concurrency at least 1")
    if args.burst < 1 or (args.burst > 1 and (args.workload != "kv-pressure" or args.concurrency is not None)):
        parser.error("--burst is at least 1, and more only for kv-pressure's Poisson arrivals")
    if args.scale_out and args.workload != "kv-pressure":
        parser.error("--scale-out is a kv-pressure run")
    if args.tenants == 1 or args.tenants < 0:
        parser.error("--tenants is at least 2 (or 0: no keys)")
    result = compare_routing(args.config, args.model, policies, workload=args.workload, kv_blocks=args.kv_blocks,
                             gateways=args.gateways, rate=args.rate, concurrency=args.concurrency,
                             burst=args.burst, scale_out=args.scale_out, tenants=args.tenants)
    pressure = args.workload == "kv-pressure"
    if args.tenants:
        print("\n" + isolation_section(result))
    else:
        print("\n" + (kv_pressure_section(result) if pressure else routing_section(result)))
    out = args.out or Path("results/routing-tenants.json" if args.tenants else
                           "results/routing-kv-pressure-scale-out.json" if args.scale_out else
                           "results/routing-kv-pressure.json" if pressure else "results/routing.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "routing-kv-pressure" if pressure else "routing", **result,
                               **environment()}, indent=1))
    print(f"\nwritten to {out} ({result['wall_s']:.0f} s)")
    return 0
