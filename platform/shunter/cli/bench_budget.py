"""`shunter bench budget`: the per-token CPU budget of every process of a serving side, profiled.

Issue 39 asks where the serving CPU goes, token by token, and what the platform burns at rest. For
Shunter (serving only the model, as in `shunter bench overhead`) and for vLLM's own OpenAI server (the
reference), this reports:
- the idle tax: each process's CPU milliseconds per second over `--idle-seconds` with nothing sent, after
  a warm-up (what `top` shows at rest);
- at each concurrency level (64-token streamed chats, `ignore_eos`, the chat prompts of `bench overhead`,
  whole requests for `--seconds`, so that py-spy gets enough samples): each process's CPU time (psutil, by
  thread), split into steps by py-spy samples of every Python platform process (shunter.bench.profile),
  as microseconds per generated token, and the side's serving CPU per 1,000 tokens (everything but vLLM's
  engine processes and this client, as in shunter.bench.cpu).

    shunter bench budget [--sides shunter,vllm-server] [--concurrency 1,8,32] [--seconds 15] [--quick]

The processes are this command's descendants (the local Ray cluster, vLLM's server and their children),
not the whole machine. vLLM's engine core and workers are measured but not profiled (their time is the
model's), and neither are C/C++ daemons (raylet, gcs_server, HAProxy). psutil's CPU times come in clock
ticks (10 ms): 0.5 ms/s at idle over 20 s, about 1 us per token over 10,000 tokens.

py-spy runs `--nonblocking` (no pauses of the process it reads) with `--threads` (the OS thread ids that
let a process's CPU be split by thread). Its own CPU is reported apart, and it is not small: each sample
reads every Python thread's stack, about 3% of a core per Ray process at 50 Hz, which on two cores slows
the engine. So under load only the processes that took 5% or more of the warm-up's serving CPU get the
full `--rate`, the others `--cold-rate` (their time is mostly the idle tax, profiled at the full rate at
idle). The raw files stay under `<out>-pyspy/<side>/<window>/` for flame graphs (`flamegraph.pl file.txt
> file.svg`). py-spy must be allowed to read other processes' memory: root, CAP_SYS_PTRACE, or
`kernel.yama.ptrace_scope=0`. Benchmarks report; they never assert.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shunter.bench.profile import NOT_PROFILED, Samples, parse_raw, role_of, scaled, split_cpu, tally

SIDES = ("shunter", "vllm-server")
PYSPY_MAX_S = 3600  # py-spy's --duration, a cap: each recording is stopped (SIGINT) when its window ends
ATTACH_S = 1.0  # py-spy's start, before the window's CPU is read


@dataclass
class _Proc:
    role: str
    kind: str  # shunter.bench.profile.ROLES: platform, engine, profiler
    python: bool
    cpu_s: float
    threads: dict[int, tuple[str, float]]  # tid -> (name, CPU seconds)


def _thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:  # the thread ended in between: its time is still read
        return "?"


def _snapshot() -> dict[tuple[int, float], _Proc]:
    """(pid, start time) -> process, for every descendant of this process."""
    import psutil

    found: dict[int, tuple[float, int, str, str, float, dict[int, tuple[str, float]]]] = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            with proc.oneshot():
                title = f"{' '.join(proc.cmdline())} {proc.name()}"  # the kernel's name: set by setproctitle too
                times = proc.cpu_times()
                threads = {t.id: (_thread_name(proc.pid, t.id), t.user_time + t.system_time) for t in proc.threads()}
                found[proc.pid] = (proc.create_time(), proc.ppid(), title, Path(proc.exe()).name,
                                   times.user + times.system, threads)
        except (psutil.Error, OSError):
            continue  # gone, or a zombie
    out: dict[tuple[int, float], _Proc] = {}
    kinds: dict[int, str] = {}
    for pid, (created, ppid, title, exe, cpu, threads) in sorted(found.items(), key=lambda item: item[1][0]):
        role, kinds[pid] = role_of(title, found.get(ppid, (0.0, 0, ""))[2], kinds.get(ppid, ""))  # parents first
        out[(pid, created)] = _Proc(role, kinds[pid], exe.startswith("python"), cpu, threads)
    return out


def _cpu() -> str:
    """The CPU model and the ISA that decides the engine's speed (DESIGN.md: beside every table)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    isa = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags][:2]
    return f"{model} ({', '.join(isa) or 'no AVX2'})"


def _pyspy() -> str:
    """py-spy's path, once it has read a process here (fail now, not after minutes of starting a cluster)."""
    found = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if not found:
        raise SystemExit("py-spy not found: pip install 'py-spy>=0.3' (in the dev extra)")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        probe = subprocess.run([found, "dump", "--nonblocking", "--pid", str(child.pid)], capture_output=True,
                               text=True, timeout=60)
    finally:
        child.kill()
        child.wait()
    if probe.returncode != 0:
        raise SystemExit(f"py-spy cannot read another process here ({probe.stderr.strip()[-300:]}); run as root, "
                         "with CAP_SYS_PTRACE, or with kernel.yama.ptrace_scope=0")
    return found


@dataclass
class Plan:
    """What one run measures, the same for every side."""

    levels: list[int]
    max_tokens: int = 64
    seconds: float = 15.0  # each level sends whole requests for at least this long...
    requests_per_stream: int | None = None  # ...or exactly this many per stream
    idle_s: float = 20.0
    rate: int = 50  # py-spy's samples per second: every process at idle, the hot ones under load
    cold_rate: int = 5  # the other processes under load (py-spy's own cost is per process and thread)
    raw: Path = Path("results/budget-pyspy")
    exe: str = "py-spy"


class _Recording:
    """py-spy on every Python platform process, from start() to stop()."""

    def __init__(self, plan: Plan, folder: Path, hot: set[int] | None):
        self.plan, self.folder, self.hot = plan, folder, hot  # hot None: every process at the full rate
        self.running: dict[int, tuple[subprocess.Popen, Path]] = {}
        self.rates: dict[str, int] = {}

    def start(self, procs: dict[tuple[int, float], _Proc]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for (pid, _), proc in procs.items():
            if proc.kind != "platform" or not proc.python:
                continue
            rate = self.plan.rate if self.hot is None or pid in self.hot else self.plan.cold_rate
            self.rates[f"{proc.role} ({pid})"] = rate
            path = self.folder / f"{re.sub(r'[^A-Za-z0-9]+', '-', proc.role).strip('-').lower()}-{pid}.txt"
            cmd = [self.plan.exe, "record", "--format", "raw", "--rate", str(rate), "--nonblocking", "--threads",
                   "--pid", str(pid), "--duration", str(PYSPY_MAX_S), "-o", str(path)]
            with open(path.with_suffix(".log"), "w") as log:  # a file, not a pipe nobody reads until the end
                self.running[pid] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), path)

    def stop(self) -> tuple[dict[int, Samples], float]:
        """Samples by pid, and py-spy's own CPU seconds (read just before it is stopped)."""
        import psutil

        spent = 0.0
        for popen, _ in self.running.values():
            try:
                times = psutil.Process(popen.pid).cpu_times()
                spent += times.user + times.system
                popen.send_signal(signal.SIGINT)  # py-spy writes what it has and exits
            except (psutil.Error, ProcessLookupError):
                pass
        samples = {}
        for pid, (popen, path) in self.running.items():
            try:
                popen.wait(60)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
            samples[pid] = tally(parse_raw(path.read_text())) if path.exists() else Samples()
        return samples, spent


def _cpu_by_pid(before: dict, after: dict) -> dict[int, float]:
    return {key[0]: proc.cpu_s - (before[key].cpu_s if key in before else 0.0) for key, proc in after.items()
            if proc.kind == "platform"}


def _usage(before: dict, after: dict, samples: dict[int, Samples], since: float) -> tuple[dict[str, dict], Counter]:
    """Per role: CPU seconds, by step and by native thread name; and the leaves no owner claimed."""
    roles: dict[str, dict] = {}
    unmatched: Counter = Counter()
    for key, proc in after.items():
        old = before.get(key)  # None: started within the window, all of its time counts...
        if proc.kind == "profiler" or (old is None and key[1] < since - 0.1):
            continue  # ...unless it is older than the window and was not read at its start: no baseline
        cpu = max(0.0, proc.cpu_s - (old.cpu_s if old else 0.0))
        threads = {tid: (name, max(0.0, c - (old.threads.get(tid, (name, 0.0))[1] if old else 0.0)))
                   for tid, (name, c) in proc.threads.items()}
        native: dict[str, float] = {}
        if proc.kind == "platform" and proc.python and key[0] in samples:
            steps, native = split_cpu(cpu, threads, samples[key[0]])
            unmatched.update(samples[key[0]].unmatched)
        else:
            steps = {NOT_PROFILED: cpu}
        role = roles.setdefault(proc.role, {"kind": proc.kind, "processes": 0, "cpu_s": 0.0, "steps": Counter(),
                                            "native_threads": Counter()})
        role["processes"] += 1
        role["cpu_s"] += cpu
        role["steps"].update(steps)
        role["native_threads"].update(native)
    return roles, unmatched


async def _window(plan: Plan, folder: Path, hot: set[int] | None, action) -> dict[str, Any]:
    """Run `action()` under py-spy and CPU accounting."""
    recording = _Recording(plan, folder, hot)
    recording.start(_snapshot())
    await asyncio.sleep(ATTACH_S)
    since = time.time()
    before = _snapshot()
    start = time.perf_counter()
    result = await action()
    wall = time.perf_counter() - start
    after = _snapshot()
    samples, spy_cpu = recording.stop()
    roles, unmatched = _usage(before, after, samples, since)
    return {"result": result, "wall_s": wall, "roles": roles, "unmatched": unmatched.most_common(10),
            "pyspy_cpu_s": spy_cpu, "pyspy_rates": recording.rates}


def _normalised(roles: dict[str, dict], per: float, unit: float) -> dict[str, dict]:
    return {role: {"kind": r["kind"], "processes": r["processes"], "cpu_s": r["cpu_s"],
                   "total": r["cpu_s"] / per * unit if per > 0 else 0.0, "steps": scaled(dict(r["steps"]), per, unit),
                   "native_threads": scaled(dict(r["native_threads"]), per, unit)} for role, r in roles.items()}


async def profile_side(side: str, base_url: str, model: str, plan: Plan) -> dict[str, Any]:
    from shunter.bench.loadgen import LoadConfig, run_load
    from shunter.bench.workloads import Session, Turn
    from shunter.cli.bench_peers import QUESTIONS

    sessions = [Session(i, [Turn(question, 0, plan.max_tokens)]) for i, question in enumerate(QUESTIONS)]

    def load(concurrency: int, requests: int | None = None, seconds: float | None = None):
        return run_load(sessions, LoadConfig(base_url=f"{base_url}/v1", model=model, concurrency=concurrency,
                                             max_requests=requests, duration_s=seconds, progress=False))

    # Warm-up (first requests compile, allocate, connect), measured: the processes that take 5% or more of
    # its serving CPU are the hot ones, sampled at the full rate under load.
    before = _snapshot()
    await load(4, 8)
    warm = _cpu_by_pid(before, _snapshot())
    hot = {pid for pid, cpu in warm.items() if cpu >= 0.05 * sum(warm.values())}
    await asyncio.sleep(2)  # the warm-up's tail (metrics pushes, the last chunks) is not the idle tax
    idle = await _window(plan, plan.raw / side / "idle", None, lambda: asyncio.sleep(plan.idle_s))
    out: dict[str, Any] = {"idle": {"seconds": idle["wall_s"], "roles": _normalised(idle["roles"], idle["wall_s"], 1e3),
                                    **{k: idle[k] for k in ("unmatched", "pyspy_cpu_s", "pyspy_rates")}},
                           "levels": []}
    for concurrency in plan.levels:
        requests = max(2, concurrency * plan.requests_per_stream) if plan.requests_per_stream else None
        seconds = None if requests else plan.seconds
        run = await _window(plan, plan.raw / side / f"c{concurrency}", hot,
                            lambda c=concurrency, n=requests, s=seconds: load(c, n, s))
        records = run["result"][0]
        failed = [r for r in records if not r.ok]
        if failed:  # a budget with failures in it would flatter the side that failed
            raise RuntimeError(f"{side}: {len(failed)} of {len(records)} requests failed: {failed[0].error}")
        tokens = sum(r.output_tokens for r in records)
        serving = sum(r["cpu_s"] for r in run["roles"].values() if r["kind"] == "platform")
        out["levels"].append({"concurrency": concurrency, "requests": len(records), "output_tokens": tokens,
                              "wall_s": run["wall_s"], "tokens_per_s": tokens / run["wall_s"], "serving_cpu_s": serving,
                              "serving_cpu_ms_per_1k": serving / max(1, tokens) * 1e6,
                              "roles": _normalised(run["roles"], tokens, 1e6),
                              **{k: run[k] for k in ("unmatched", "pyspy_cpu_s", "pyspy_rates")}})
        print(f"{side} c={concurrency}: {tokens} tokens in {run['wall_s']:.1f} s, serving CPU "
              f"{out['levels'][-1]['serving_cpu_ms_per_1k']:.0f} ms per 1k tokens", flush=True)
    return out


def measure(config: Path, model_name: str, sides: list[str], plan: Plan) -> dict[str, Any]:
    from shunter.cli.app_files import generate_model_of
    from shunter.cli.bench_overhead import _single_model_app
    from shunter.cli.bench_peers import vllm_server
    from shunter.cpu_dtype import engine_dtype
    from shunter.local_serve import local_serve

    plan.exe = _pyspy()
    cfg, model, path = generate_model_of(config, model_name)
    shutil.rmtree(plan.raw, ignore_errors=True)  # this command's own folder: no stale recordings beside new ones
    found: dict[str, Any] = {}
    for side in sides:
        if side == "vllm-server":
            proc, url = vllm_server(path, model.name, model.engine)
            try:
                found[side] = asyncio.run(profile_side(side, url, model.name, plan))
            finally:
                proc.terminate()
                proc.wait(60)
        else:
            with local_serve() as local:
                local.deploy(_single_model_app(cfg, model.name), "bench")
                found[side] = asyncio.run(profile_side(side, local.base_url, model.name, plan))
    return {"model": model.name, "dtype": engine_dtype(model.engine.dtype, "cpu", model.engine.quantization),
            "cpu": _cpu(), "plan": {**asdict(plan), "raw": str(plan.raw)}, "sides": found}


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}" if abs(value) >= 10 else f"{value:.1f}"


def totals_table(by_side: dict[str, dict[str, dict]], unit: str) -> str:
    """Rows: every process role (engine ones marked), then the serving side's sum; a column per side."""
    sides = list(by_side)
    roles = sorted({r for roles in by_side.values() for r in roles},
                   key=lambda r: -max(by_side[s].get(r, {}).get("total", 0.0) for s in sides))
    lines = [f"| process | {' | '.join(f'{s} ({unit})' for s in sides)} |", "|---|" + "---|" * len(sides)]
    for role in roles:
        kind = next(by_side[s][role]["kind"] for s in sides if role in by_side[s])
        label = role + (" (engine)" if kind == "engine" else "")
        lines.append(f"| {label} | {' | '.join(_cell(by_side[s].get(role, {}).get('total')) for s in sides)} |")
    serving = [sum(r["total"] for r in by_side[s].values() if r["kind"] == "platform") for s in sides]
    lines.append(f"| **serving (all but the engine)** | {' | '.join(f'**{_cell(v)}**' for v in serving)} |")
    return "\n".join(lines)


def steps_table(by_side: dict[str, dict[str, dict]], unit: str, floor: float) -> str:
    """Rows: (platform process, step), largest first; steps under `floor` on every side folded per process."""
    sides = list(by_side)
    rows: list[tuple[float, str, str, list[float | None]]] = []
    roles = {r for roles in by_side.values() for r, v in roles.items() if v["kind"] == "platform"}
    for role in roles:
        order = max(by_side[s].get(role, {}).get("total", 0.0) for s in sides)
        steps = {st for s in sides for st in by_side[s].get(role, {}).get("steps", {})}
        small: list[float | None] = [None] * len(sides)
        for step in steps:
            values = [by_side[s][role]["steps"].get(step) if role in by_side[s] else None for s in sides]
            if max(v or 0.0 for v in values) >= floor:
                rows.append((order, role, step, values))
            else:
                small = [None if a is None and b is None else (a or 0.0) + (b or 0.0) for a, b in zip(small, values, strict=True)]
        if any(v for v in small):
            rows.append((order, role, f"(steps under {floor:g} {unit})", small))
    rows.sort(key=lambda r: (-r[0], r[1], r[2].startswith("("), -max(v or 0.0 for v in r[3])))
    lines = [f"| process | step | {' | '.join(f'{s} ({unit})' for s in sides)} |", "|---|---|" + "---|" * len(sides)]
    lines += [f"| {role} | {step} | {' | '.join(_cell(v) for v in values)} |" for _, role, step, values in rows]
    return "\n".join(lines)


def report(result: dict[str, Any]) -> str:
    sides, plan = result["sides"], result["plan"]
    out = [f"# CPU budget: {result['model']} ({result['dtype']}), {plan['max_tokens']}-token streamed chats, "
           f"{result.get('cpu', '?')}", "",
           f"py-spy at {plan['rate']} Hz on every Python platform process at idle; under load on those that took 5% "
           f"or more of the warm-up's serving CPU, at {plan['cold_rate']} Hz on the others.", "",
           "## Idle tax (CPU ms per second, nothing sent)", "",
           totals_table({s: v["idle"]["roles"] for s, v in sides.items()}, "ms/s"), "",
           steps_table({s: v["idle"]["roles"] for s, v in sides.items()}, "ms/s", 0.5)]
    levels = [lvl["concurrency"] for lvl in next(iter(sides.values()))["levels"]]
    for i, concurrency in enumerate(levels):
        at = {s: v["levels"][i] for s, v in sides.items()}
        out += ["", f"## {concurrency} streams (microseconds of CPU per generated token)", "",
                "; ".join(f"{s}: {a['output_tokens']} tokens in {a['wall_s']:.1f} s ({a['tokens_per_s']:.1f} tok/s), "
                          f"serving CPU **{a['serving_cpu_ms_per_1k']:.0f} ms per 1k tokens**, py-spy itself "
                          f"{a['pyspy_cpu_s']:.1f} CPU-s" for s, a in at.items()), "",
                totals_table({s: a["roles"] for s, a in at.items()}, "us/token"), "",
                steps_table({s: a["roles"] for s, a in at.items()}, "us/token", 1.0)]
        for s, a in at.items():
            native = sorted(((f"{role}: {name}", v) for role, r in a["roles"].items()
                             for name, v in r["native_threads"].items() if v >= 1.0), key=lambda item: -item[1])
            if native:  # Ray's C++ threads are named after the process title when they started (ray::IDLE)
                out.append(f"\n{s}, native threads by name (us/token): "
                           + "; ".join(f"{name} {_cell(v)}" for name, v in native[:6]))
            if a["unmatched"]:
                out.append(f"\n{s}, samples no owner claimed (leaf frame: samples): "
                           + "; ".join(f"`{leaf}`: {n}" for leaf, n in a["unmatched"][:6]))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shunter bench budget", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"some of {', '.join(SIDES)}")
    parser.add_argument("--concurrency", default=None, help="default 1,8,32 (--quick: 1,32)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=None,
                        help="each level sends whole requests for at least this long (default 15, --quick 5)")
    parser.add_argument("--requests-per-stream", type=int, default=None,
                        help="instead of --seconds: exactly this many requests per stream at each level")
    parser.add_argument("--idle-seconds", type=float, default=None, help="default 20 (--quick: 10)")
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second: every process at idle, "
                        "the hot ones under load (default 50)")
    parser.add_argument("--cold-rate", type=int, default=5, help="py-spy samples per second under load for the "
                        "processes that took under 5%% of the warm-up's serving CPU (default 5)")
    parser.add_argument("--quick", action="store_true", help="levels 1 and 32, short runs: to try it")
    parser.add_argument("--out", type=Path, default=Path("results/budget.json"))
    args = parser.parse_args(argv)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - set(SIDES):
        parser.error(f"--sides: some of {', '.join(SIDES)}")
    levels = [int(c) for c in (args.concurrency or ("1,32" if args.quick else "1,8,32")).split(",")]
    plan = Plan(levels, args.max_tokens, args.seconds or (5.0 if args.quick else 15.0), args.requests_per_stream,
                args.idle_seconds if args.idle_seconds is not None else (10.0 if args.quick else 20.0), args.rate,
                args.cold_rate, args.out.with_name(args.out.stem + "-pyspy"))
    from shunter.bench.runner import environment

    result = measure(args.config, args.model, sides, plan)
    print("\n" + report(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "budget", **result, **environment()}, indent=1))
    print(f"\nwritten to {args.out}; py-spy's raw files under {plan.raw}")
    return 0
