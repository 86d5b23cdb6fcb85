"""Where a benchmark run's CPU went: the engines' processes, and everything else the serving side ran.

A platform in front of an engine should cost almost nothing per token; on a CPU node whatever it costs
comes straight out of the engine. `CpuMeter` reads every process's CPU time (user + system) before and
after a run, and splits the difference: vLLM's engine-core and model-worker processes (titled
`VLLM::EngineCore` and `VLLM::Worker`) are the engine; every other process but the benchmark's own client (this process) is the serving side: vLLM's
API server for vLLM's own server, and for Shunter or Ray Serve LLM the replicas' front ends (request
parsing, detokenization, SSE), the gateway, Serve's proxy and controller, and Ray's own daemons. Divided
by the tokens the run generated, that is the per-token cost of everything but the model, on any hardware.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

# vLLM's process titles (setproctitle): the engine core's scheduler loop and the model's workers.
ENGINE_TITLES = ("VLLM::EngineCore", "VLLM::Worker")


# Shunter's per-node fork server (shunter.engine_forkserver): every process it forks is an engine core or
# worker, and keeps the server's command line (vLLM's title never reaches it in a forked child).
FORK_SERVER = "shunter.engine_forkserver"


def _starts_engines(label: str) -> bool:
    """Serve replicas (Shunter's, Ray Serve LLM's) and vLLM's own API server start engine processes."""
    return label.startswith("ray::ServeReplica") or "vllm.entrypoints" in label


@dataclass
class CpuUse:
    engine_s: float
    serving_s: float
    top: list[tuple[str, float]]  # the serving side's busiest processes: (name, CPU seconds)

    def per_1k_tokens(self, tokens: int) -> float:
        """Serving-side CPU milliseconds per 1,000 generated tokens."""
        return self.serving_s / max(1, tokens) * 1e6


def _snapshot() -> dict[tuple[int, float], tuple[str, float]]:
    """(pid, start time) -> (label, CPU seconds). An engine process is labelled by its vLLM title. Its
    title does not always reach its command line (seen here: an engine core still showing as Python's
    `multiprocessing.spawn` child with 20 s of CPU), so a spawned child of a Serve replica or of vLLM's
    API server, the processes that start engines, counts as the engine too, and so does a child of
    Shunter's fork server and every descendant of an engine process."""
    me = os.getpid()
    found: dict[int, tuple[float, str, int, float]] = {}
    for proc in psutil.process_iter(["pid", "ppid", "create_time", "cmdline", "name"]):
        try:
            if proc.info["pid"] == me:
                continue
            times = proc.cpu_times()
            label = " ".join(proc.info["cmdline"] or []) or proc.info["name"] or "?"
            found[proc.info["pid"]] = (proc.info["create_time"], label, proc.info["ppid"] or 0,
                                       times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    labels = {pid: label for pid, (_, label, _, _) in found.items()}
    for pid, (_, label, ppid, _) in found.items():
        if "multiprocessing.spawn" in label and _starts_engines(labels.get(ppid, "")):
            labels[pid] = f"{ENGINE_TITLES[0]} (untitled: {label})"
        elif FORK_SERVER in label and FORK_SERVER in labels.get(ppid, ""):
            labels[pid] = f"{ENGINE_TITLES[0]} (forked: {label})"
    # A child of an engine process is the engine's too (its workers: a worker whose title never reached its
    # command line was once counted as 8-13 s of serving CPU).
    changed = True
    while changed:
        changed = False
        for pid, (_, label, ppid, _) in found.items():
            if not labels[pid].startswith(ENGINE_TITLES) and labels.get(ppid, "").startswith(ENGINE_TITLES):
                labels[pid] = f"{ENGINE_TITLES[1]} (untitled: {label})"
                changed = True
    return {(pid, created): (labels[pid], cpu) for pid, (created, _, _, cpu) in found.items()}


class CpuMeter:
    """`start()` before a run, `stop()` after it: the CPU seconds spent in between, by side."""

    def __init__(self) -> None:
        self._before: dict[tuple[int, float], tuple[str, float]] = {}

    def start(self) -> None:
        self._before = _snapshot()

    def stop(self) -> CpuUse:
        engine = serving = 0.0
        spent: list[tuple[str, float]] = []
        for key, (label, total) in _snapshot().items():
            used = total - self._before.get(key, (label, 0.0))[1]  # a process started mid-run: all of it
            if used <= 0:
                continue
            if label.startswith(ENGINE_TITLES):
                engine += used
            else:
                serving += used
                spent.append((label[:80], used))
        spent.sort(key=lambda item: -item[1])
        return CpuUse(engine, serving, spent[:6])
