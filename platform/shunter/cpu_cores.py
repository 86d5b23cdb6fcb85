"""Give each CPU engine replica its own cores on its node.

vLLM's default CPU binding (`auto`) computes on the same cores in every engine of a machine, so two
engines halve each other; an engine bound to cores nobody else uses runs up to 1.6x faster (see the
design doc). The platform therefore decides, per replica:

- how many cores: `cores_per_replica` (from the config, resolved when the app is built: a node's cores
  split evenly among the app's CPU engine replicas). The replica actor reserves the same number of Ray
  CPUs, so Ray never places more engines on a node than it has cores for them.
- which cores: claimed at replica start from the node's free cores, each held by an exclusive `flock` on
  a per-core lock file. The kernel drops a lock when its process dies, so a crashed replica can never
  leak cores, and no coordinator actor is needed on the routing or start-up path.

Because each replica reserves its cores as Ray CPUs, engines that together ask for more cores than the
node has do not fail: Ray leaves the ones that do not fit pending forever. So the builder (and
`shunter config check`, `shunter plan`) adds up what the app starts with (`core_shortfall`) and refuses a
config that cannot fit, naming the models and the fix; what only scaling out or a rollout would need
beyond the node's cores is a warning (`core_headroom`): those replicas wait until cores free up.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


def default_lock_dir() -> Path:
    return Path(os.environ.get("SHUNTER_CORE_LOCK_DIR") or Path(tempfile.gettempdir()) / "shunter-cpu-cores")


def node_cores() -> list[int]:
    """Cores this process may run on (respects cgroup/affinity limits), in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


class NotEnoughCores(RuntimeError):
    """Fewer free cores on this node than the replica was planned with."""


@dataclass
class CoreClaim:
    """Cores held by this process until `release()` or process exit."""

    cores: list[int]
    _fds: list[int] = field(default_factory=list, repr=False)

    def omp_bind(self, ranks: int = 1) -> str:
        """VLLM_CPU_OMP_THREADS_BIND value: the cores split evenly among `ranks` (TP ranks), `|`-joined."""
        if ranks < 1 or len(self.cores) < ranks:
            raise NotEnoughCores(f"{len(self.cores)} cores cannot host {ranks} ranks with a core each")
        per_rank = len(self.cores) // ranks
        groups = [self.cores[i * per_rank : (i + 1) * per_rank] for i in range(ranks)]
        return "|".join(",".join(str(c) for c in group) for group in groups)

    def release(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)  # closing the descriptor drops its flock
            except OSError:
                pass
        self._fds.clear()


def claim_cores(count: int, lock_dir: Path | None = None, candidates: list[int] | None = None) -> CoreClaim:
    """Claim `count` free cores of this node, lowest first; raise NotEnoughCores if too few are free."""
    if count < 1:
        raise ValueError("count must be at least 1")
    lock_dir = lock_dir or default_lock_dir()
    lock_dir.mkdir(parents=True, exist_ok=True)
    claim = CoreClaim(cores=[])
    for core in candidates if candidates is not None else node_cores():
        if len(claim.cores) == count:
            break
        fd = os.open(lock_dir / f"core-{core}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        claim.cores.append(core)
        claim._fds.append(fd)
    if len(claim.cores) < count:
        got = list(claim.cores)
        claim.release()
        raise NotEnoughCores(
            f"needed {count} free cores on this node, found {len(got)} ({got}); other engine replicas "
            f"hold the rest (lock files in {lock_dir}). Lower cpu_cores_per_replica or the replica count."
        )
    return claim


def cores_per_replica(node_cpus: int, engine_replicas: int) -> int:
    """auto: a node's cores split evenly among the app's CPU engine replicas, at least one each."""
    return max(1, node_cpus // max(1, engine_replicas))


@dataclass(frozen=True)
class CoreDemand:
    """The cores one model's CPU engine replicas own: `cores` each (at least one per TP x PP rank),
    `start` replicas when the app starts (its live versions' fixed count, or the autoscaler's first
    max(1, min_replicas)), `most` at most (max_replicas, and a rollout's second version beside the first)."""

    model: str
    cores: int
    start: int
    most: int
    setting: str  # cpu_cores_per_replica as the config gives it: "auto" or a number
    start_field: str = "replicas"  # what sets `start`, named in the message
    most_field: str = "replicas"  # what sets `most`
    rollout: bool = False  # `most` counts a rollout's second version

    def line(self, replicas: int, counted: str) -> str:
        how = "auto, at least 1 per engine rank" if self.setting == "auto" \
            else str(self.setting)
        return (f"models[{self.model}]: {replicas} replica{'s' if replicas != 1 else ''} ({counted}) x "
                f"{self.cores} core{'s' if self.cores != 1 else ''} (cpu_cores_per_replica: {how}) "
                f"= {replicas * self.cores}")


def core_shortfall(demands: list[CoreDemand], node_cpus: int, node: str = "the node") -> str | None:
    """Why the replicas the app starts with cannot all get their cores on `node`, or None when they fit."""
    need = sum(d.cores * d.start for d in demands)
    if need <= node_cpus:
        return None
    lines = [d.line(d.start, d.start_field) for d in demands if d.start and d.cores]
    return (f"the CPU engines this config starts need {need} cores; {node} has {node_cpus}, so Ray would "
            "leave the replicas that do not fit pending forever:\n  " + "\n  ".join(lines) + "\n"
            "Fix: fewer replicas (replicas, autoscaling.min_replicas), `cpu_cores_per_replica: shared` for a "
            "light model (it owns no cores and runs beside the others), or a node with at least "
            f"{need} cores.")


def core_headroom(demands: list[CoreDemand], node_cpus: int, node: str = "the node") -> str | None:
    """Why replicas past the start (scaled out, or a rollout's new version) would wait for cores, or None."""
    most = sum(d.cores * d.most for d in demands)
    if most <= node_cpus:
        return None
    lines = [d.line(d.most, d.most_field) for d in demands if d.most and d.cores]
    rollout = any(d.rollout for d in demands)
    return (f"the CPU engines of this config need up to {most} cores at their most; {node} has {node_cpus}: "
            "replicas past its cores wait (pending) until cores free up"
            + (", and a rollout whose new version cannot start is rolled back after rollout.ready_timeout_s"
               if rollout else "") + ":\n  " + "\n  ".join(lines))
