"""`shunter bench builds`: the Shunter side of `shunter bench overhead` for several commits of this
repository, in one run.

Figures taken in different runs on this shared VM vary by up to about 30%, so "no slower than before"
can only be shown by measuring before and after in the same run. Each REF is checked out into a git
worktree and installed (not editable) into a folder of its own; every measurement runs in a child
process with that folder first on PYTHONPATH (ahead of the venv's editable install), and the Ray
cluster the child starts hands it to every worker, Serve replicas included. Rounds are interleaved
(A B C A B C), so drift hits every build alike; the table gives each build's medians over the rounds
and its ratios to the first REF, the baseline.

    shunter bench builds REF [REF ...] [--rounds 2] [--concurrency 1,8,32] [--max-tokens 64]
                         [--config configs/local.yaml] [--model smollm2-135m-instruct] [--out results/builds.json]

The same REF twice (HEAD HEAD) measures the noise itself. Benchmarks report; they never assert.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

METRICS = ("tokens_per_s", "ttft_p50_s", "serving_cpu_ms_per_1k")

# Runs in the child, against the build on PYTHONPATH: only what every measured commit has.
CHILD = """
import asyncio, dataclasses, json, sys
from pathlib import Path
import shunter
from shunter.cli.app_files import generate_model_of
from shunter.cli.bench_overhead import _single_model_app, bench_openai_endpoint
from shunter.local_serve import local_serve

a = json.loads(sys.argv[1])
if not shunter.__file__.startswith(a["site"]):
    sys.exit(f"this child imported shunter from {shunter.__file__}, not from {a['site']}")
cfg, model, _ = generate_model_of(Path(a["config"]), a["model"])
with local_serve() as local:
    local.deploy(_single_model_app(cfg, model.name), "bench")
    runs = asyncio.run(bench_openai_endpoint("shunter", local.base_url, model.name, a["levels"], a["max_tokens"]))
    import ray
    which = lambda *_: __import__("shunter").__file__
    names = [n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if "REPLICA" in n["name"]]
    try:  # where each Serve replica imported shunter from; else where a plain Ray worker does
        workers = {n: ray.get(ray.get_actor(n, namespace="serve").__ray_call__.remote(which)) for n in names}
    except Exception as exc:
        print(f"replicas not asked ({exc!r}); a Ray task instead", file=sys.stderr)
        workers = {"ray task": ray.get(ray.remote(num_cpus=0)(which).remote())}
rows = [{**dataclasses.asdict(r), "tokens_per_s": r.tokens_per_s, "serving_cpu_ms_per_1k": r.serving_cpu_ms_per_1k,
         "ttft_p50_s": r.ttft_p50_s} for r in runs]
Path(a["result"]).write_text(json.dumps({"shunter_file": shunter.__file__, "workers_shunter_file": workers,
                                         "runs": rows}))
"""


@dataclass
class Build:
    label: str
    ref: str
    sha: str
    worktree: str
    site: str


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="shunter bench builds", description=__doc__.split("\n\n")[0])
    parser.add_argument("refs", nargs="+", metavar="REF", help="commits of this repository; the first is the baseline")
    parser.add_argument("--rounds", type=int, default=2, help="each build measured this many times, interleaved")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--own-config", action="store_true",
                        help="each build reads --config from its own worktree (for configs an older build rejects)")
    parser.add_argument("--out", type=Path, default=Path("results/builds.json"))
    args = parser.parse_args(argv)
    try:
        args.levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency: comma-separated integers, not {args.concurrency!r}")
    if args.rounds < 1 or args.max_tokens < 1 or min(args.levels) < 1:
        parser.error("--rounds, --max-tokens and every --concurrency level must be at least 1")
    return args


def build_labels(refs: list[str], shas: list[str]) -> list[str]:
    """A unique label per REF: the short commit, with the ref's name where it is not a commit prefix;
    a REF given again gets #2, #3."""
    labels: list[str] = []
    for ref, sha in zip(refs, shas, strict=True):
        commit = len(ref) >= 4 and all(c in "0123456789abcdef" for c in ref.lower()) and sha.startswith(ref.lower())
        label = sha[:7] if commit else f"{ref} ({sha[:7]})"
        n = sum(1 for other in labels if other == label or other.startswith(f"{label} #"))
        labels.append(f"{label} #{n + 1}" if n else label)
    return labels


def schedule(labels: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, build) in measuring order: every build once per round, in the order given (A B C A B C)."""
    return [(r, label) for r in range(1, rounds + 1) for label in labels]


def _median(values: list[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else statistics.median(values)


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def aggregate(samples: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    """Per concurrency level: each build's medians over the rounds of every metric, the rounds' tokens/s,
    and each median's ratio to the baseline's (labels[0])."""
    rows = []
    for level in sorted({s["concurrency"] for s in samples}):
        builds: dict[str, dict[str, Any]] = {}
        for label in labels:
            runs = [s for s in samples if s["build"] == label and s["concurrency"] == level]
            builds[label] = {"rounds": len(runs), "tokens_per_s_rounds": [r["tokens_per_s"] for r in runs],
                             **{m: _median([r[m] for r in runs]) for m in METRICS}}
        base = builds[labels[0]]
        for entry in builds.values():
            entry.update({f"{m}_vs_base": _ratio(entry[m], base[m]) for m in METRICS})
        rows.append({"concurrency": level, "builds": builds})
    return rows


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict[str, Any]], labels: list[str]) -> str:
    """Markdown: per build, median tokens/s (spread of the rounds, TTFT p50) and serving CPU ms per 1k
    tokens; per later build, its ratios to the baseline."""
    head, rule = ["streams"], ["---"]
    for i, label in enumerate(labels):
        head += [f"{label} tok/s (±spread, TTFT p50)", f"{label} CPU ms/1k"]
        head += [f"{label} / {labels[0]}: tok/s, TTFT p50, CPU"] if i else []
    rule += ["---"] * (len(head) - 1)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
    for row in rows:
        cells = [str(row["concurrency"])]
        for i, label in enumerate(labels):
            b = row["builds"][label]
            tps = b["tokens_per_s_rounds"]
            spread = (max(tps) - min(tps)) / 2 / b["tokens_per_s"] * 100 if len(tps) > 1 and b["tokens_per_s"] else None
            ttft = None if b["ttft_p50_s"] is None else b["ttft_p50_s"] * 1000
            cells.append(f"{_num(b['tokens_per_s'], '.1f')} (±{_num(spread, '.0f')}%, {_num(ttft, '.0f')} ms)")
            cells.append(_num(b["serving_cpu_ms_per_1k"], ".0f"))
            if i:
                cells.append(", ".join(_num(b[f"{m}_vs_base"], ".2f") for m in METRICS))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()


def _prepare(sha: str, tmp: Path) -> tuple[str, str]:
    """A worktree of `sha` and its non-editable install; checks that a child with it on PYTHONPATH
    imports that install, not the venv's editable one."""
    worktree, site = tmp / f"wt-{sha[:12]}", tmp / f"site-{sha[:12]}"
    _git("worktree", "add", "--detach", str(worktree), sha)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                    "--target", str(site), str(worktree)], check=True)
    seen = subprocess.run([sys.executable, "-c", "import shunter; print(shunter.__file__)"], cwd=worktree,
                          env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True,
                          check=True).stdout.strip()
    if not seen.startswith(str(site)):
        raise SystemExit(f"{sha[:7]}: with PYTHONPATH={site}, shunter comes from {seen}")
    return str(worktree), str(site)


def _run_child(build: Build, config: Path, args: argparse.Namespace, result: Path) -> dict[str, Any]:
    payload = {"site": build.site, "config": str(config), "model": args.model, "levels": args.levels,
               "max_tokens": args.max_tokens, "result": str(result)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(payload)], cwd=build.worktree,
                            env={**os.environ, "PYTHONPATH": build.site})
    try:
        rc = proc.wait()
    except BaseException:  # Ctrl-C or the like: let local_serve stop its Ray cluster first
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    if rc != 0:
        raise SystemExit(f"{build.label}: the measuring child exited {rc}")
    out = json.loads(result.read_text())
    seen = {"driver": out["shunter_file"], **out["workers_shunter_file"]}
    wrong = {where: file for where, file in seen.items() if not file.startswith(build.site)}
    if wrong or len(seen) < 2:
        raise SystemExit(f"{build.label}: shunter imported from {wrong or seen}, not all inside {build.site}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from shunter.bench.runner import environment

    root = Path(_git("rev-parse", "--show-toplevel"))
    config = args.config.resolve()
    if args.own_config and not config.is_relative_to(root):
        raise SystemExit(f"--own-config: {config} is not inside this repository ({root})")
    shas = [_git("rev-parse", "--verify", f"{ref}^{{commit}}") for ref in args.refs]
    labels = build_labels(args.refs, shas)
    tmp = Path(tempfile.mkdtemp(prefix="shunter-builds-"))
    prepared: dict[str, tuple[str, str]] = {}
    try:
        for sha in shas:
            prepared[sha] = prepared.get(sha) or _prepare(sha, tmp)
        builds = {label: Build(label, ref, sha, *prepared[sha])
                  for label, ref, sha in zip(labels, args.refs, shas, strict=True)}
        configs = {label: (Path(b.worktree) / config.relative_to(root) if args.own_config else config)
                   for label, b in builds.items()}
        for label, b in builds.items():
            own = Path(b.worktree) / config.relative_to(root) if config.is_relative_to(root) else None
            if not args.own_config and own is not None and (not own.exists() or own.read_bytes() != config.read_bytes()):
                print(f"note: {label}'s own {own.relative_to(b.worktree)} differs from the one measured "
                      "(--own-config uses each build's own)", file=sys.stderr)
        samples, imports = [], {}
        for n, (round_, label) in enumerate(schedule(labels, args.rounds)):
            print(f"\n== round {round_}/{args.rounds}: {label}", file=sys.stderr, flush=True)
            out = _run_child(builds[label], configs[label], args, tmp / f"result-{n}.json")
            imports[label] = {k: out[k] for k in ("shunter_file", "workers_shunter_file")}
            samples += [{"build": label, "round": round_, **run} for run in out["runs"]]
        rows = aggregate(samples, labels)
    finally:
        for worktree, _ in prepared.values():
            subprocess.run(["git", "worktree", "remove", "--force", worktree], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nShunter side of `bench overhead`, medians over {args.rounds} interleaved round(s), "
          f"baseline {labels[0]}; spread: half the rounds' tokens/s range\n" + table(rows, labels))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "builds", "model": args.model, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "config": str(config), "own_config": args.own_config,
        "builds": [{**asdict(b), **imports[b.label]} for b in builds.values()],
        "rows": rows, "samples": samples, **environment()}, indent=1))
    print(f"\nwritten to {args.out}")
    for label in labels:
        print(f"{label}: shunter imported by the driver from {imports[label]['shunter_file']}, by "
              + ", ".join(f"{w} from {f}" for w, f in imports[label]["workers_shunter_file"].items()))
    return 0
