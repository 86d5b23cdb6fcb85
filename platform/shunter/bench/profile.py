"""Where a serving process's CPU goes, from py-spy's raw samples: the pure half of `shunter bench budget`.

py-spy (`record --format raw --threads`) writes one line per distinct stack: `thread (TID): NAME;frame;...;
frame COUNT`, root first, each frame `function (file:line)`. Each sample is booked to a *step* (the gateway's
relay, the token channel, Ray Serve's machinery, vLLM's serving layer...) by the file paths on its stack,
with one ordered table, `OWNERS`, that says which paths belong to which step:

- the stack is read from the leaf outward, and the first frame an owner claims names the step: code with
  no owner of its own (the standard library's json, pydantic, an asyncio queue) works for the first owner
  above it, so `json.dumps` called by the relay is the relay's;
- where several owners' paths fit one frame, the first in the table wins (so `ray/_private/runtime_env/`
  is the agents', not Ray core's);
- the event loop's own dispatch (asyncio's `_run_once` and `Handle._run`, selectors, uvloop, a thread
  pool's worker loop) names the step "event loop" when it is reached first: the loop was polling or
  dispatching, whichever library started it. uvloop's loop is C, so there the leaf is the frame that
  started it (Ray Serve's `_run_user_code_event_loop`): a leaf named like a loop runner is the loop too.
  ("Event loop only when nothing else is on the stack" would book the loop's own work to Ray Serve, which
  starts the replicas' loops, or to vLLM's entry point);
- a stack no owner claims is "event loop" when it holds asyncio or threading frames, else "other", and
  its leaf frame is counted so that the table can be extended where it falls short.

A process's CPU is split by thread (`split_cpu`): a thread py-spy sampled gives its CPU time to the steps
of its samples; a thread it never sampled ran no Python (Ray's C++ core-worker threads, gRPC's): its time
is booked as native, by thread name. Scaling each process's psutil CPU time this way, rather than by its
pooled sample shares, keeps C++ threads from being charged to whichever Python code was sampled.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

OTHER = "other"
EVENT_LOOP = "event loop"
NATIVE = "native threads (no Python frames)"
NO_SAMPLES = "(no py-spy samples)"
NOT_PROFILED = "(not profiled)"


@dataclass(frozen=True)
class Owner:
    step: str
    paths: tuple[str, ...]  # fragments of a frame's file path, matched against "/" + the path py-spy shows


# Order matters only where one frame fits several owners: specific before general. A fragment starts with
# "/" so that it matches whole folder names. py-spy shows a site-packages file from the package folder on
# ("ray/serve/_private/router.py") and one of Shunter's editable install in full ("/work/main/deployments/..").
OWNERS: tuple[Owner, ...] = (
    Owner("gateway: stream account", ("/deployments/gateway/stream_account.py",
                                      "/deployments/gateway/stream_filter.py")),  # its name before: older builds
    Owner("gateway: relay", ("/deployments/gateway/relay.py", "/deployments/gateway/replica_stream.py")),
    Owner("token channel", ("/deployments/token_channel.py",)),
    Owner("gateway: telemetry and settle", tuple(f"/deployments/gateway/{m}.py" for m in (
        "telemetry", "request_end", "usage", "traffic"))),
    Owner("gateway: door and admission", ("/deployments/gateway/flow/",  # admission, flow_queue: older builds
                                          *(f"/deployments/gateway/{m}.py" for m in (
        "forward", "request_body", "parsed_request", "access", "admission", "flow_queue", "priority", "quotas",
        "rate_headers", "context", "tiering", "lora", "retry_places", "replica_call", "openai_routes", "api_app",
        "parts", "draining", "serving_state")))),
    Owner("gateway: other", ("/deployments/gateway/",)),
    Owner("replica: Shunter", ("/deployments/replica/", "/shunter/engine", "/shunter/vllm_compat.py",
                               "/shunter/replica_protocol.py", "/shunter/kv_events.py")),
    Owner("routing (Shunter's router)", ("/routing/",)),
    Owner("metrics and tracing", ("/prometheus_client/", "/opentelemetry/", "/shunter/ray_metrics.py",
                                  "/shunter/tracing.py", "/vllm/v1/metrics/", "/ray/util/metrics.py")),
    Owner("Shunter: other", ("/deployments/", "/shunter/")),
    Owner("vLLM serving layer", ("/vllm/entrypoints/", "/vllm/renderers/", "/vllm/parser/")),
    Owner("vLLM output processing", ("/vllm/v1/engine/", "/vllm/v1/serial_utils.py",
                                     "/vllm/transformers_utils/detokenizer", "/vllm/tokenizers/", "/tokenizers/",
                                     "/transformers/tokenization_utils")),
    Owner("vLLM: other", ("/vllm/",)),
    Owner("HTTP server (uvicorn/Starlette)", ("/uvicorn/", "/h11/", "/httptools/", "/starlette/", "/fastapi/",
                                              "/anyio/")),
    Owner("Ray Serve machinery", ("/ray/serve/",)),
    Owner("Ray dashboard, agents and monitors", ("/ray/dashboard/", "/ray/autoscaler/", "/ray/_private/runtime_env/",
                                                 "/ray/_private/log_monitor.py", "/aiohttp/")),
    Owner("Ray core", ("/ray/_private/", "/ray/_raylet", "/ray/util/", "/ray/_common/", "/ray/actor.py",
                       "/ray/remote_function.py", "/ray/experimental/", "/ray/core/")),
    Owner("ZeroMQ/msgpack", ("/zmq/", "/msgpack/")),
    Owner("gRPC (Python)", ("/grpc/",)),
    Owner("Ray: other", ("/ray/",)),
)
# The loop itself at work: polling, or calling back into whatever runs next.
LOOP_DISPATCH = ("/asyncio/base_events.py", "/asyncio/events.py", "/asyncio/selector_events.py", "/selectors.py",
                 "/uvloop/", "/concurrent/futures/thread.py")
# With uvloop the loop is C: while it polls and dispatches, the leaf is the Python frame that started it.
LOOP_RUNNERS = ("event_loop", "run_forever", "run_until_complete")
# Scheduling code that works for whoever called it (a queue's get, a lock, a thread's bootstrap): counted
# as the event loop only when no owner is on the stack at all.
LOOP_FALLBACK = ("/asyncio/", "/threading.py", "/queue.py", "/concurrent/futures/")


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.function} ({self.file})"


@dataclass
class Stack:
    frames: tuple[Frame, ...]  # root first, as py-spy writes them
    count: int
    tid: int | None = None  # the OS thread id (`--threads`); psutil's and /proc's thread id
    thread: str = ""


_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
_THREAD = re.compile(r"^thread \((?P<tid>0x[0-9a-fA-F]+|\d+)\)(?:: (?P<name>.*))?$")


def parse_frame(text: str) -> Frame:
    """`function (file:line)`; anything else (a bare name) is kept as the function, with no file."""
    found = _FRAME.match(text.strip())
    if not found:
        return Frame(text.strip(), "")
    line = found.group("line")
    return Frame(found.group("function"), found.group("file"), int(line) if line else None)


def parse_raw(text: str) -> list[Stack]:
    """py-spy's raw (collapsed) format; blank and malformed lines are skipped."""
    stacks = []
    for line in text.splitlines():
        body, _, count = line.rstrip().rpartition(" ")
        if not body or not count.isdigit():
            continue
        parts = body.split(";")
        tid, name = None, ""
        thread = _THREAD.match(parts[0])
        if thread:
            tid, name = int(thread.group("tid"), 0), thread.group("name") or ""
            parts = parts[1:]
        stacks.append(Stack(tuple(parse_frame(p) for p in parts), int(count), tid, name))
    return stacks


def _fits(frame: Frame, paths: tuple[str, ...]) -> bool:
    # From the package folder on, so that a checkout under a folder named like an owner (~/shunter/.venv/..)
    # never claims the libraries installed in it.
    where = "/" + frame.file.rpartition("-packages/")[2].lstrip("/")
    return any(p in where for p in paths)


def classify(frames: tuple[Frame, ...] | list[Frame], owners: tuple[Owner, ...] = OWNERS) -> str:
    """The step of one sample (frames root first); see the module docstring for the rules."""
    if frames and any(name in frames[-1].function for name in LOOP_RUNNERS):
        return EVENT_LOOP
    for frame in reversed(frames):
        for owner in owners:
            if _fits(frame, owner.paths):
                return owner.step
        if _fits(frame, LOOP_DISPATCH):
            return EVENT_LOOP
    return EVENT_LOOP if any(_fits(f, LOOP_FALLBACK) for f in frames) else OTHER


@dataclass
class Samples:
    """One process's samples: steps by thread, and the leaves of the samples no owner claimed."""

    by_tid: dict[int | None, Counter] = field(default_factory=dict)
    unmatched: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.by_tid.values())


def tally(stacks: list[Stack], owners: tuple[Owner, ...] = OWNERS) -> Samples:
    out = Samples()
    for stack in stacks:
        step = classify(stack.frames, owners)
        out.by_tid.setdefault(stack.tid, Counter())[step] += stack.count
        if step == OTHER and stack.frames:
            out.unmatched[str(stack.frames[-1])] += stack.count
    return out


def split_cpu(total_s: float, threads: dict[int, tuple[str, float]],
              samples: Samples) -> tuple[dict[str, float], dict[str, float]]:
    """A process's CPU seconds by step, and its native threads' by thread name.

    `threads`: tid -> (name, CPU seconds) over the window for the threads alive at its end; `total_s` is the
    process's own figure, which also holds the threads that ended within the window: that remainder goes to
    the sampled threads no longer alive, pooled, or to NATIVE when none was sampled."""
    steps: Counter = Counter()
    native: Counter = Counter()
    if not samples.total:
        return ({NO_SAMPLES: total_s} if total_s > 0 else {}), {}

    def spend(seconds: float, counts: Counter) -> None:
        n = sum(counts.values())
        for step, k in counts.items():
            steps[step] += seconds * k / n

    for tid, (name, cpu) in threads.items():
        counts = samples.by_tid.get(tid)
        if counts and sum(counts.values()):
            spend(cpu, counts)
        elif cpu > 0:
            steps[NATIVE] += cpu
            native[name] += cpu
    ended = total_s - sum(cpu for _, cpu in threads.values())
    if ended > 0:
        gone: Counter = Counter()
        for tid, counts in samples.by_tid.items():
            if tid not in threads:
                gone.update(counts)
        if gone:
            spend(ended, gone)
        else:
            steps[NATIVE] += ended
            native["(threads that ended)"] += ended
    return dict(steps), dict(native)


def scaled(seconds: dict[str, float], per: float, unit: float) -> dict[str, float]:
    """CPU seconds to a rate: per token (per = tokens, unit 1e6: microseconds per token) or per second of
    wall time (per = seconds, unit 1e3: milliseconds per second)."""
    return {key: value / per * unit for key, value in seconds.items()} if per > 0 else {}


# What each process of a side is, from its command line (Ray's and vLLM's process titles), first match
# wins: (fragment, role, kind). Kinds: "engine" (vLLM's engine core and workers: neither serving CPU nor
# profiled, as in shunter.bench.cpu), "profiler" (py-spy itself), "platform" (everything else).
ROLES: tuple[tuple[str, str, str], ...] = (
    ("VLLM::Engine", "vLLM engine core", "engine"),  # the kernel's name for it stops at 15 characters
    ("VLLM::Worker", "vLLM worker", "engine"),
    ("py-spy", "py-spy", "profiler"),
    ("vllm.entrypoints", "vLLM API server", "platform"),
    ("ray::ServeController", "Serve controller", "platform"),
    ("ray::ProxyActor", "Serve proxy actor", "platform"),
    ("ray::HAProxyManager", "HAProxy manager (Ray actor)", "platform"),
    ("/haproxy", "HAProxy", "platform"),
    ("/raylet", "raylet", "platform"),
    ("/gcs_server", "gcs_server", "platform"),
    ("ray::DashboardAgent", "Ray dashboard agent", "platform"),
    ("dashboard/agent.py", "Ray dashboard agent", "platform"),
    ("ray::RuntimeEnvAgent", "Ray runtime-env agent", "platform"),
    ("runtime_env/agent", "Ray runtime-env agent", "platform"),
    ("dashboard/dashboard.py", "Ray dashboard", "platform"),
    ("log_monitor.py", "Ray log monitor", "platform"),
    ("autoscaler/_private/monitor.py", "Ray autoscaler monitor", "platform"),
    ("multiprocessing.resource_tracker", "multiprocessing resource tracker", "platform"),
    ("ray::", "Ray worker (other)", "platform"),
)
_REPLICA = re.compile(r"ray::ServeReplica:[^:\s]+:(?P<deployment>[^\s.]+)")


def role_of(title: str, parent_title: str = "", parent_kind: str = "") -> tuple[str, str]:
    """(role, kind) of a process from its title (command line, and the kernel's name for it). A Serve
    replica by its deployment (the title's `.method` suffix, which Ray changes as the replica runs, dropped).
    An engine's title does not always reach its command line (seen: a worker showing as plain `python`
    with 10 CPU-s), so a child of an engine process is the engine too, and a `multiprocessing.spawn` child
    of a replica or of vLLM's API server is the engine core (shunter.bench.cpu)."""
    replica = _REPLICA.search(title)
    if replica:
        deployment = replica.group("deployment")
        if deployment == "gateway" or "Gateway" in deployment:
            return "gateway replica", "platform"
        if deployment.startswith("model-") or "ModelServer" in deployment:
            return "model replica", "platform"
        return f"Serve replica {deployment}", "platform"
    found = next(((role, kind) for fragment, role, kind in ROLES if fragment in title), None)
    if parent_kind == "engine":
        return found if found and found[1] == "engine" else ("vLLM worker", "engine")
    if "multiprocessing.spawn" in title and ("ray::ServeReplica" in parent_title
                                              or "vllm.entrypoints" in parent_title):
        return "vLLM engine core", "engine"
    return found or ("other: " + (title.split() or ["?"])[0].rsplit("/", 1)[-1][:40], "platform")
