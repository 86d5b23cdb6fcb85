"""A forked process takes the OpenMP threads and cores its environment names, as a spawned one does.

Why: OpenMP runtimes (libgomp, Intel's libiomp) read OMP_NUM_THREADS and their binding variables once, when
the library loads. vLLM's CPU executor binds each worker by setting them (OMP_NUM_THREADS plus
GOMP_CPU_AFFINITY, KMP_AFFINITY or OMP_PLACES, per runtime) just before it starts the worker, which works
when the worker is a fresh interpreter. A process forked from the node's server (shunter.engine_forkserver)
has the runtime the server loaded, configured from the *server's* environment: it ignored the binding and
ran as many threads as the server's environment said (all of the node's cores when it said nothing). Two
engines that each ran two unbound threads on two cores, spinning at every barrier, finished nothing of a
32-stream flood in 300 s; bound, one thread each on its own core, they finish it in about two minutes.

What: `adopt()` reads those variables and applies them through calls that act after load: the process's
CPU affinity (the threads the runtime starts later inherit it) and torch's thread count (the runtime's
`omp_set_num_threads`). The server registers it to run in every child forked below it, and runs it again
in a child once that child has its requester's environment.
"""

from __future__ import annotations

import logging
import os
import re
import sys

log = logging.getLogger(__name__)


def threads() -> int | None:
    """OMP_NUM_THREADS' outermost level (it may list one per nesting level), if set to a positive count."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def cores() -> set[int] | None:
    """The cores the binding variables name (Intel's runtime's, GNU's, then the standard's), if any."""
    kmp = re.search(r"proclist=\[([^\]]*)\]", os.environ.get("KMP_AFFINITY", ""))
    if kmp:
        return _core_list(kmp.group(1))
    if os.environ.get("GOMP_CPU_AFFINITY", "").strip():
        return _core_list(os.environ["GOMP_CPU_AFFINITY"])
    places = os.environ.get("OMP_PLACES", "").strip()
    if places.startswith("{"):
        return _core_list(places.replace("{", " ").replace("}", " "))
    return None  # unset, or an abstract name (cores, threads, sockets): nothing explicit to bind to


def _core_list(text: str) -> set[int] | None:
    """Cores from a list such as "0 1 2", "0,1", "0-3" or "0-6:2" (every second); None if it is not one."""
    found: set[int] = set()
    for item in filter(None, re.split(r"[\s,]+", text.strip())):
        match = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", item)
        if not match:
            return None
        first, last, stride = int(match[1]), int(match[2] or match[1]), int(match[3] or 1)
        if last < first or stride < 1:
            return None
        found.update(range(first, last + 1, stride))
    return found or None


def adopt() -> None:
    """Bind this process to the cores its environment names and run the thread count it names. Quiet and
    harmless where neither is set; torch is only told if it is already imported (the server preloads it)."""
    bound = cores()
    if bound:
        try:
            os.sched_setaffinity(0, bound)
        except (OSError, AttributeError) as exc:  # cores outside this process's cgroup, or not Linux
            log.warning("could not bind to cores %s: %s", sorted(bound), exc)
    count = threads()
    torch = sys.modules.get("torch")
    if count and torch is not None:
        torch.set_num_threads(count)
