"""`shunter bench contention`: who goes first when the model is full. One model (one replica on every
core), the same engine settings on every side, every side measured in one run:

- `vllm-fcfs`: vLLM's own OpenAI server, first come first served;
- `vllm-priority`: vLLM's own server with `--scheduling-policy priority`, each request sent with the
  per-request `priority` of its class (interactive 0, standard 1, batch 2: lower goes first);
- `ray-serve-llm`: Ray Serve LLM 2.60 (`--no-ray-serve-llm` leaves it out);
- `shunter-no-classes`: Shunter with one API key per tenant, every key in class `standard`, engine fcfs;
- `shunter-classes`: the keys with their classes (light: interactive, flood: batch, the two same-class
  tenants: standard), engine `scheduling_policy: priority`, each class's queueing deadline its goodput
  TTFT target (`--default-deadlines`: the built-in ones);
- `shunter-classes-fcfs` (`--with-classes-fcfs`): the same classes on an fcfs engine (does the engine's
  priority scheduling earn its place as the default?);
- `shunter-classes-share75` (by `--sides` only): those, with batch work allowed 75% of the engine's
  sequences instead of the default half (the default until run 4 of docs/benchmarks.md section 10: what
  less headroom gives the flood, and costs the light tenant).

The workloads, one after another on each side (after a warmup):
1. noisy neighbour: a light tenant sends one 16-token chat every 2 s, alone and then while a flood tenant
   keeps 64 streams of 128 tokens running (the flood alone first, its throughput with nobody else: on
   Shunter's sides with classes after `flow_control.headroom_hold_s` without interactive work, so the batch
   class may fill the engine);
2. two tenants of one class at 3:1 (132 and 44 streams of 16 tokens, equal weights, together far past what
   the engine runs at once, each more than half of it): the output tokens each was served against its weight;
   then the same two as a flood and a light tenant (260 streams of 48 tokens past the admission bound, one
   8-token chat every 1.5 s): is the light tenant refused, and its TTFT p99 against its own idle one;
3. goodput at 2x overload: interactive and batch requests arriving (seeded Poisson) at twice the engine's
   capacity (the first side's flood-alone throughput); goodput = requests whose first token came within
   their class's TTFT target, per second. A request refused with `Retry-After` is sent once more after it
   (before the arrivals end, the same body again, as OpenAI's SDKs retry; each arrival's question is
   numbered, so no two arrivals send the same body); the wait it then saw, from the refusal to its first
   token, is what `Retry-After` is measured against (4).

Every request streams (`ignore_eos`, temperature 0); TTFT is the first content chunk, throughput and
shares count output tokens (the running usage on every chunk) arriving inside a phase's window (its first seconds, the engine filling, left out). A
phase ends by hanging up on what still runs. Results: results/contention.json; the tables and the goal
lines: shunter.cli.bench_contention_report.

    shunter bench contention [--quick] [--no-ray-serve-llm] [--with-classes-fcfs] [--sides a,b]

`shunter bench contention --batch`: a batch (OpenAI's Batch API) beside an interactive tenant instead
(shunter.cli.bench_batch).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from shunter.cli.bench_peers import QUESTIONS
from shunter.config.flow import FlowControlConfig

CLASS_PRIORITY = {"interactive": 0, "standard": 1, "batch": 2}  # vLLM's per-request priority: lower first
TENANTS = ("light", "flood", "tenant-a", "tenant-b")
TENANT_CLASS = {"light": "interactive", "flood": "batch", "tenant-a": "standard", "tenant-b": "standard"}
COOL_DOWN_S = 3.0  # after a phase hangs up, for the engine to drop what it was running
# How long the Shunter sides hold the batch class's headroom after an interactive arrival (the default).
HEADROOM_HOLD_S = FlowControlConfig.model_fields["headroom_hold_s"].default


@dataclass(frozen=True)
class Side:
    name: str
    server: str  # vllm | ray-serve-llm | shunter
    scheduling_policy: str = "fcfs"  # the engine's
    classes: bool = False  # Shunter: the keys carry their tenants' classes (else every key is standard)
    batch_share: float | None = None  # Shunter with classes: the batch class's capacity_share (None: built-in)

    @property
    def sends_priority(self) -> bool:
        """vLLM's own server told each request's class as its `priority` (Shunter's gateway does it itself)."""
        return self.server == "vllm" and self.scheduling_policy == "priority"

    @property
    def keys(self) -> bool:
        return self.server == "shunter"


SIDES = {s.name: s for s in (
    Side("vllm-fcfs", "vllm"),
    Side("vllm-priority", "vllm", "priority"),
    Side("ray-serve-llm", "ray-serve-llm"),
    Side("shunter-no-classes", "shunter"),
    Side("shunter-classes", "shunter", "priority", classes=True),
    Side("shunter-classes-fcfs", "shunter", "fcfs", classes=True),
    Side("shunter-classes-share75", "shunter", "fcfs", classes=True, batch_share=0.75),
)}
DEFAULT_SIDES = ("vllm-fcfs", "vllm-priority", "ray-serve-llm", "shunter-no-classes", "shunter-classes")


@dataclass(frozen=True)
class Durations:
    """Seconds. `--quick` scales every phase by 1/4 (the light tenant's interval stays)."""

    light_alone_s: float = 30.0
    light_interval_s: float = 2.0
    flood_alone_s: float = 45.0
    flood_s: float = 90.0
    settle_s: float = 10.0  # a flood phase's first seconds: left out of its throughput
    light_timeout_s: float = 180.0  # a light request with no answer by then counts as unanswered
    shares_s: float = 60.0
    shares_settle_s: float = 20.0  # the slots' first occupants, in arrival order, leave by then
    goodput_s: float = 60.0
    same_light_alone_s: float = 30.0  # the same-class light tenant alone (its idle TTFT)
    same_class_s: float = 60.0  # then beside its class's flood
    same_light_interval_s: float = 1.5

    def scaled(self, factor: float) -> Durations:
        kept = ("light_interval_s", "same_light_interval_s")
        return replace(self, **{k: v * factor for k, v in asdict(self).items() if k not in kept})


@dataclass(frozen=True)
class Workload:
    light_tokens: int = 16
    flood_streams: int = 64
    flood_tokens: int = 128
    # tenant-a, tenant-b: 3:1, together past Shunter's 64 slots and within its 128 queued (no refusals), and
    # b alone past half the slots, so each has requests waiting for its share
    share_streams: tuple[int, int] = (132, 44)
    share_weights: tuple[float, float] = (1.0, 1.0)
    share_tokens: int = 16
    overload: float = 2.0  # goodput arrivals: this many times the engine's capacity
    interactive_share: float = 0.5  # of the goodput arrivals
    interactive_tokens: int = 16
    batch_tokens: int = 128
    # a flood and a light tenant of one class (tenant-a and tenant-b, both standard): the flood past
    # Shunter's admission bound (64 slots + 128 queued), the light one an 8-token chat every 1.5 s
    same_flood_streams: int = 260
    same_flood_tokens: int = 48
    same_light_tokens: int = 8
    target_interactive_s: float = 2.0  # goodput: TTFT targets by class
    target_batch_s: float = 30.0
    seed: int = 0

    def target_s(self, klass: str) -> float:
        return self.target_interactive_s if klass == "interactive" else self.target_batch_s


# ---- schedules (pure) ----

def light_schedule(start_s: float, end_s: float, interval_s: float) -> list[float]:
    """When the light tenant sends: every `interval_s` from `start_s`, before `end_s`."""
    if interval_s <= 0:
        raise ValueError("the light tenant's interval must be positive")
    count = max(0, math.ceil((end_s - start_s) / interval_s - 1e-9))
    return [start_s + i * interval_s for i in range(count)]


def share_order(streams: tuple[int, int]) -> list[str]:
    """The two tenants' streams interleaved in proportion (3:1: a, a, a, b, ...), so neither starts first."""
    a, b = streams
    order: list[str] = []
    taken_a = taken_b = 0
    while taken_a < a or taken_b < b:
        if taken_b >= b or (taken_a < a and (taken_a + 1) * b <= (taken_b + 1) * a):
            order.append("tenant-a")
            taken_a += 1
        else:
            order.append("tenant-b")
            taken_b += 1
    return order


def mean_goodput_tokens(w: Workload) -> float:
    return w.interactive_share * w.interactive_tokens + (1 - w.interactive_share) * w.batch_tokens


def goodput_rate(capacity_tok_s: float, w: Workload) -> float:
    """Goodput arrivals per second: `overload` times the requests of the mix the engine serves a second."""
    if not capacity_tok_s > 0:
        raise ValueError("the engine's capacity must be positive")
    return w.overload * capacity_tok_s / mean_goodput_tokens(w)


def goodput_schedule(rate: float, duration_s: float, interactive_share: float,
                     seed: int = 0) -> list[tuple[float, str]]:
    """(arrival second, class): Poisson arrivals at `rate` for `duration_s`, each interactive with
    probability `interactive_share`, else batch. The same seed gives every side the same arrivals."""
    rng = random.Random(seed)
    out: list[tuple[float, str]] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append((t, "interactive" if rng.random() < interactive_share else "batch"))
        t += rng.expovariate(rate)
    return out


# ---- one request ----

@dataclass
class Shot:
    """One request. Times are seconds on its phase's clock."""

    tenant: str
    klass: str
    sent_s: float
    status: int | None = None
    head_s: float | None = None
    first_s: float | None = None
    done_s: float | None = None
    tokens: list[tuple[float, int]] = field(default_factory=list)  # (arrival, output tokens it added)
    output_tokens: int = 0
    retry_after_s: float | None = None
    error: str | None = None
    retry: Shot | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done_s is not None and self.error is None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s

    def brief(self) -> dict[str, Any]:
        """What results/contention.json keeps of it (no chunk times)."""
        out = {k: getattr(self, k) for k in ("tenant", "klass", "sent_s", "status", "head_s", "first_s", "done_s",
                                             "output_tokens", "retry_after_s", "error")}
        out["retry"] = self.retry.brief() if self.retry is not None else None
        return out


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (the delta form; an HTTP date or garbage: None)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


class Client:
    """One side's streaming chat client; each tenant sends with its own key where the side has keys."""

    def __init__(self, base_url: str, model: str, side: Side, keys: dict[str, str] | None = None,
                 transport: Any = None):
        import logging

        import httpx

        logging.getLogger("httpx").setLevel(logging.WARNING)  # Ray's logging setup would log every request
        self.model, self.side, self.keys = model, side, keys or {}
        self.http = httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(900, connect=30), transport=transport,
                                      limits=httpx.Limits(max_connections=512, max_keepalive_connections=256))

    async def close(self) -> None:
        await self.http.aclose()

    def body(self, shot: Shot, max_tokens: int, question: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": question}],
                                "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                                "temperature": 0, "ignore_eos": True}
        if self.side.sends_priority:
            body["priority"] = CLASS_PRIORITY[shot.klass]
        return body

    async def send(self, shot: Shot, max_tokens: int, t0: float, question: str) -> Shot:
        import httpx

        key = self.keys.get(shot.tenant)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            async with self.http.stream("POST", "/v1/chat/completions", json=self.body(shot, max_tokens, question),
                                        headers=headers) as resp:
                shot.status, shot.head_s = resp.status_code, time.perf_counter() - t0
                if resp.status_code != 200:
                    shot.retry_after_s = parse_retry_after(resp.headers.get("retry-after"))
                    shot.error = (await resp.aread()).decode("utf-8", "replace")[:200]
                    return shot
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        shot.done_s = time.perf_counter() - t0
                        return shot
                    event = json.loads(data)
                    if "error" in event:
                        shot.error = json.dumps(event)[:200]
                        return shot
                    now = time.perf_counter() - t0
                    text = any((c.get("delta") or {}).get("content") for c in event.get("choices") or [])
                    usage = event.get("usage") or {}
                    counted = int(usage.get("completion_tokens") or 0) if usage else None
                    # a chunk may carry several tokens (the server's output merged while its reader lagged):
                    # the running usage on every chunk says how many; without it, one per content chunk
                    added = counted - shot.output_tokens if counted is not None else int(text)
                    if added > 0:
                        shot.tokens.append((now, added))
                        shot.output_tokens += added
                    if text and shot.first_s is None:
                        shot.first_s = now
                shot.error = "stream ended without [DONE]"
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            shot.error = f"{type(exc).__name__}: {exc}"[:200]
        except asyncio.CancelledError:
            shot.error = shot.error or "hung up"
            raise
        return shot


# ---- load shapes ----

def ramp(streams: int, ramp_s: float) -> list[float]:
    """When each of a closed loop's streams starts: spread evenly over `ramp_s`. Started together, streams of
    one length would finish together for good, and an arrival would wait for the whole wave."""
    return [i * ramp_s / streams for i in range(streams)]


class ClosedLoop:
    """`len(order)` streams (started over `ramp_s`), each sending again as soon as its last request ends
    (after a refusal, it waits Retry-After, 1 s without one), until stopped; stopping hangs up on the
    requests in flight."""

    def __init__(self, client: Client, order: list[str], max_tokens: int, t0: float, shots: list[Shot],
                 ramp_s: float = 0.0):
        self.stop = asyncio.Event()
        self.tasks = [asyncio.create_task(self._stream(client, tenant, i, max_tokens, t0, shots, at))
                      for (i, tenant), at in zip(enumerate(order), ramp(len(order), ramp_s), strict=True)]

    async def _stream(self, client: Client, tenant: str, i: int, max_tokens: int, t0: float,
                      shots: list[Shot], at: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        while not self.stop.is_set():
            shot = Shot(tenant, TENANT_CLASS[tenant], time.perf_counter() - t0)
            shots.append(shot)
            await client.send(shot, max_tokens, t0, QUESTIONS[i % len(QUESTIONS)])
            if not shot.ok:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), shot.retry_after_s or 1.0)

    async def hang_up(self) -> None:
        self.stop.set()
        await _cancel(self.tasks)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def open_loop(client: Client, arrivals: list[tuple[float, str, str, int]], t0: float, shots: list[Shot],
              timeout_s: float | None = None, retry_until_s: float | None = None) -> list[asyncio.Task]:
    """Each arrival (second, tenant, class, max_tokens) sent at its time, whatever came before; one with no
    answer within `timeout_s` is hung up on. A refusal with Retry-After is sent once more after it, when that
    falls before `retry_until_s` (its second attempt is the shot's `retry`)."""

    async def one(i: int, at: float, tenant: str, klass: str, max_tokens: int) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        shot = Shot(tenant, klass, time.perf_counter() - t0)
        shots.append(shot)
        # Every arrival a request of its own (a retry is the same body again, and Shunter finds the place its
        # refusal kept by it): the 8 questions, numbered.
        question = f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})"
        try:
            await asyncio.wait_for(client.send(shot, max_tokens, t0, question), timeout_s)
        except TimeoutError:
            shot.error = f"no answer within {timeout_s:g} s"
            return
        wait = shot.retry_after_s
        if retry_until_s is None or shot.status not in (429, 503) or wait is None or shot.head_s is None:
            return
        if shot.head_s + wait >= retry_until_s:
            return
        await asyncio.sleep(max(0.0, t0 + shot.head_s + wait - time.perf_counter()))
        shot.retry = Shot(tenant, klass, time.perf_counter() - t0)
        await client.send(shot.retry, max_tokens, t0, question)

    return [asyncio.create_task(one(i, *a)) for i, a in enumerate(arrivals)]


# ---- the workloads on one side ----

async def warmup(client: Client) -> None:
    shots: list[Shot] = []
    t0 = time.perf_counter()
    await asyncio.gather(*open_loop(client, [(0.0, t, TENANT_CLASS[t], 8) for t in TENANTS * 2], t0, shots, 300))
    failed = [s for s in shots if not s.ok]
    if failed:
        raise RuntimeError(f"{client.side.name}: warmup failed: {failed[0].status} {failed[0].error}")


async def _light_alone(client: Client, tenant: str, tokens: int, alone_s: float, interval_s: float,
                       d: Durations) -> list[Shot]:
    """A light tenant alone: one chat every `interval_s` for `alone_s` (its idle TTFT), then a cool-down."""
    light = [(t, tenant, TENANT_CLASS[tenant], tokens) for t in light_schedule(0.0, alone_s, interval_s)]
    alone: list[Shot] = []
    await asyncio.gather(*open_loop(client, light, time.perf_counter(), alone, d.light_timeout_s))
    await asyncio.sleep(COOL_DOWN_S)
    return alone


async def noisy_neighbour(client: Client, d: Durations, w: Workload) -> dict[str, Any]:
    # The flood alone first, once no interactive request (the warmup's) arrived within Shunter's headroom
    # hold: alone, a class may fill the whole engine there (flow_control.headroom_hold_s).
    await asyncio.sleep(HEADROOM_HOLD_S + COOL_DOWN_S if client.side.classes else 0)
    flood_alone: list[Shot] = []
    flood = ClosedLoop(client, ["flood"] * w.flood_streams, w.flood_tokens, time.perf_counter(), flood_alone,
                       d.settle_s)
    await asyncio.sleep(d.flood_alone_s)
    await flood.hang_up()
    await asyncio.sleep(COOL_DOWN_S)

    alone = await _light_alone(client, "light", w.light_tokens, d.light_alone_s, d.light_interval_s, d)

    # The flood runs on until the light tenant's last request ends: its TTFT is the flood's, however long.
    flooded: list[Shot] = []
    under: list[Shot] = []
    t0 = time.perf_counter()
    flood = ClosedLoop(client, ["flood"] * w.flood_streams, w.flood_tokens, t0, flooded, d.settle_s)
    light = [(t, "light", "interactive", w.light_tokens) for t in light_schedule(d.settle_s, d.flood_s,
                                                                                 d.light_interval_s)]
    light_tasks = open_loop(client, light, t0, under, d.light_timeout_s)
    await asyncio.sleep(d.flood_s)
    await asyncio.gather(*light_tasks)
    ran_s = time.perf_counter() - t0
    await flood.hang_up()
    await asyncio.sleep(COOL_DOWN_S)
    from shunter.cli.bench_contention_report import noisy_row

    return noisy_row(alone, under, flood_alone, flooded, d, ran_s)


async def same_class(client: Client, d: Durations, w: Workload) -> dict[str, Any]:
    """A light tenant beside a flood of its own class (issue 52, item 1): alone, then while the flood keeps
    more streams open than the model admits. Fair queueing alone orders who leaves the queue; this asks
    whether the light tenant gets into it."""
    alone = await _light_alone(client, "tenant-b", w.same_light_tokens, d.same_light_alone_s,
                               d.same_light_interval_s, d)
    flooded: list[Shot] = []
    under: list[Shot] = []
    t0 = time.perf_counter()
    flood = ClosedLoop(client, ["tenant-a"] * w.same_flood_streams, w.same_flood_tokens, t0, flooded, d.settle_s)
    light = [(t, "tenant-b", TENANT_CLASS["tenant-b"], w.same_light_tokens)
             for t in light_schedule(d.settle_s, d.same_class_s, d.same_light_interval_s)]
    await asyncio.gather(*open_loop(client, light, t0, under, d.light_timeout_s))
    await flood.hang_up()
    await asyncio.sleep(COOL_DOWN_S)
    from shunter.cli.bench_contention_report import same_class_row

    return same_class_row(alone, under, flooded)


async def shares(client: Client, d: Durations, w: Workload) -> dict[str, Any]:
    shots: list[Shot] = []
    flood = ClosedLoop(client, share_order(w.share_streams), w.share_tokens, time.perf_counter(), shots,
                       d.shares_settle_s / 2)
    await asyncio.sleep(d.shares_s)
    await flood.hang_up()
    await asyncio.sleep(COOL_DOWN_S)
    from shunter.cli.bench_contention_report import shares_row

    return shares_row(shots, dict(zip(("tenant-a", "tenant-b"), w.share_weights, strict=True)),
                      d.shares_settle_s, d.shares_s)


async def goodput(client: Client, d: Durations, w: Workload, rate: float) -> dict[str, Any]:
    """Until every request that could still meet its target has had its chance: the arrivals' end plus
    the longest target; then whatever still runs is hung up on."""
    tenants = {"interactive": ("light", w.interactive_tokens), "batch": ("flood", w.batch_tokens)}
    arrivals = [(t, tenants[k][0], k, tenants[k][1]) for t, k in goodput_schedule(rate, d.goodput_s,
                                                                                   w.interactive_share, w.seed)]
    shots: list[Shot] = []
    t0 = time.perf_counter()
    tasks = open_loop(client, arrivals, t0, shots, retry_until_s=d.goodput_s)
    cutoff = d.goodput_s + max(w.target_interactive_s, w.target_batch_s)
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + cutoff - time.perf_counter()))
    await _cancel(list(pending))
    await asyncio.sleep(COOL_DOWN_S)
    from shunter.cli.bench_contention_report import goodput_row

    return goodput_row(shots, w, d.goodput_s, rate)


async def run_side(client: Client, d: Durations, w: Workload, capacity_tok_s: float | None) -> dict[str, Any]:
    """The workloads on one side; `capacity_tok_s` None: the goodput arrivals follow this side's own
    flood-alone throughput (the first side measured sets it for the rest)."""
    started = time.perf_counter()
    await warmup(client)
    noisy = await noisy_neighbour(client, d, w)
    print(f"  noisy neighbour done ({time.perf_counter() - started:.0f} s)", flush=True)
    share = await shares(client, d, w)
    print(f"  shares done ({time.perf_counter() - started:.0f} s)", flush=True)
    same = await same_class(client, d, w)
    print(f"  same class done ({time.perf_counter() - started:.0f} s)", flush=True)
    capacity = capacity_tok_s or noisy["flood_alone_tok_s"]
    good = await goodput(client, d, w, goodput_rate(capacity, w))
    print(f"  goodput done ({time.perf_counter() - started:.0f} s)", flush=True)
    return {"side": client.side.name, "noisy": noisy, "shares": share, "same_class": same, "goodput": good,
            "capacity_tok_s": capacity, "run_s": time.perf_counter() - started}


# ---- serving each side ----

def shunter_config(cfg: Any, model: Any, side: Side, key_dir: Path, w: Workload,
                   deadlines_from_targets: bool = True) -> Any:
    """The Shunter app for `side`: the model alone on one replica with every core, one key per tenant (in its
    class with `side.classes`, else all `standard`), the engine's scheduling policy of the side; with classes,
    the interactive and batch classes' queueing deadlines are the goodput targets (a request that cannot
    start in time is refused at once, with Retry-After, instead of waiting to miss)."""
    from shunter.config import ShunterConfig
    from shunter.config.flow import FlowControlConfig

    engine = {**model.engine.model_dump(mode="json"), "scheduling_policy": side.scheduling_policy}
    served = {**model.model_dump(mode="json"), "replicas": 1, "autoscaling": None, "cpu_cores_per_replica": "auto",
              "engine": engine}
    weights = dict(zip(("tenant-a", "tenant-b"), w.share_weights, strict=True))
    keys = [{"name": tenant, "key_file": str(key_dir / f"tenant-{i}"),
             "priority_class": TENANT_CLASS[tenant] if side.classes else "standard",
             "weight": weights.get(tenant, 1.0)} for i, tenant in enumerate(TENANTS)]
    base = cfg.model_dump(mode="json")
    app = {**base, "models": [served], "auth": {"keys": keys}}
    built_in = FlowControlConfig()
    batch_share = side.batch_share if side.batch_share is not None else built_in.find("batch").capacity_share
    if side.classes and deadlines_from_targets:
        app["flow_control"] = {**base.get("flow_control", {}), "classes": [
            {"name": "interactive", "max_wait_s": w.target_interactive_s},
            {"name": "standard", "min_share": 0.1},
            {"name": "batch", "max_wait_s": w.target_batch_s, "capacity_share": batch_share, "min_share": 0.05}]}
    elif side.classes and side.batch_share is not None:  # the built-in classes, batch's share changed
        app["flow_control"] = {**base.get("flow_control", {}), "classes": [
            {**c.model_dump(mode="json"), **({"capacity_share": side.batch_share} if c.name == "batch" else {})}
            for c in built_in.classes]}
    return ShunterConfig.model_validate(app)


@contextlib.contextmanager
def serving(side: Side, cfg: Any, model: Any, path: str, key_dir: Path, w: Workload,
            deadlines_from_targets: bool) -> Iterator[str]:
    """The side up on this machine's cores: its base URL for the block, everything stopped after it."""
    if side.server == "vllm":
        from shunter.cli.bench_peers import vllm_server

        engine = model.engine.model_copy(update={"scheduling_policy": side.scheduling_policy})
        proc, url = vllm_server(path, model.name, engine)
        try:
            yield url
        finally:
            proc.terminate()
            proc.wait(60)
        return
    from shunter.local_serve import local_serve

    if side.server == "ray-serve-llm":
        from shunter.cli.bench_peers import ray_serve_llm_app

        with local_serve(direct_ingress=False) as local:
            local.deploy(ray_serve_llm_app(path, model.name, model.engine), "ray-serve-llm", ready_path="/v1/models")
            yield local.base_url
        return
    from shunter.deployments.app import assemble

    app_cfg = shunter_config(cfg, model, side, key_dir, w, deadlines_from_targets)
    with local_serve() as local:
        local.deploy(assemble(app_cfg), "contention")
        yield local.base_url


def measure(config: Path, model_name: str, sides: list[str], d: Durations, w: Workload,
            capacity_tok_s: float | None = None, deadlines_from_targets: bool = True,
            checkpoint: Path | None = None) -> dict[str, Any]:
    """Every side, one after another; the first side's flood-alone throughput sets the goodput arrivals of
    all (unless `capacity_tok_s` is given). `checkpoint`: the sides measured so far are written there after
    each (`"partial": true`), so a side that fails late loses only itself."""
    from shunter.cli.app_files import generate_model_of
    from shunter.cli.bench_routing import tenant_keys

    cfg, model, path = generate_model_of(config, model_name)
    keys, key_files = tenant_keys(len(TENANTS))
    rows = []
    started = time.perf_counter()
    with key_files:
        for name in sides:
            side = SIDES[name]
            print(f"\n== {name} ({time.perf_counter() - started:.0f} s in)", flush=True)
            with serving(side, cfg, model, path, Path(key_files.name), w, deadlines_from_targets) as url:
                row = asyncio.run(_side(url, model.name, side, dict(zip(TENANTS, keys, strict=True)), d, w,
                                        capacity_tok_s))
            capacity_tok_s = capacity_tok_s or row["capacity_tok_s"]
            rows.append(row)
            if checkpoint is not None:
                checkpoint.parent.mkdir(parents=True, exist_ok=True)
                checkpoint.write_text(json.dumps({"benchmark": "contention", "partial": True, "sides": rows},
                                                 indent=1))
    return {"model": model.name, "engine": model.engine.model_dump(mode="json"), "durations": asdict(d),
            "workload": asdict(w), "deadlines_from_targets": deadlines_from_targets, "sides": rows,
            "wall_s": time.perf_counter() - started}


async def _side(url: str, model: str, side: Side, keys: dict[str, str], d: Durations, w: Workload,
                capacity_tok_s: float | None) -> dict[str, Any]:
    client = Client(url, model, side, keys if side.keys else None)
    try:
        return await run_side(client, d, w, capacity_tok_s)
    finally:
        await client.close()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shunter bench contention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sides", default=",".join(DEFAULT_SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    p.add_argument("--no-ray-serve-llm", dest="ray_serve_llm", action="store_false")
    p.add_argument("--with-classes-fcfs", action="store_true",
                   help="add shunter-classes-fcfs: the classes on an fcfs engine")
    p.add_argument("--quick", action="store_true", help="every phase 1/4 as long (a smoke test)")
    p.add_argument("--default-deadlines", action="store_true",
                   help="shunter-classes keeps the built-in class deadlines, not the goodput targets")
    defaults = Durations()
    for name in ("light_alone_s", "flood_alone_s", "flood_s", "settle_s", "shares_s", "shares_settle_s",
                 "goodput_s", "light_timeout_s", "light_interval_s"):
        p.add_argument("--" + name[:-2].replace("_", "-"), dest=name, type=float, default=None,
                       help=f"seconds (default {getattr(defaults, name):g}"
                       + (")" if name == "light_interval_s" else ", /4 with --quick)"))
    wd = Workload()
    p.add_argument("--flood-streams", type=int, default=wd.flood_streams)
    p.add_argument("--share-streams", default=f"{wd.share_streams[0]}:{wd.share_streams[1]}",
                   help="tenant-a:tenant-b streams")
    p.add_argument("--share-weights", default=f"{wd.share_weights[0]:g}:{wd.share_weights[1]:g}",
                   help="tenant-a:tenant-b key weights (Shunter)")
    p.add_argument("--overload", type=float, default=wd.overload)
    p.add_argument("--target-interactive", type=float, default=wd.target_interactive_s, help="TTFT target, s")
    p.add_argument("--target-batch", type=float, default=wd.target_batch_s, help="TTFT target, s")
    p.add_argument("--capacity", type=float, default=None,
                   help="the engine's output tokens/s for the goodput arrivals (default: measured on the first side)")
    p.add_argument("--seed", type=int, default=wd.seed)
    p.add_argument("--out", type=Path, default=Path("results/contention.json"))
    return p


def _pair(text: str, kind: type, what: str) -> tuple[Any, Any]:
    parts = text.split(":")
    try:
        a, b = (kind(x) for x in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        a = b = None
    if a is None or b is None or not (a > 0 and b > 0):
        raise SystemExit(f"{what}: give two positive numbers as A:B, got {text!r}")
    return a, b


def options(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], Durations, Workload]:
    """The parsed flags, the sides in order, the phases' durations and the workload."""
    args = parser().parse_args(argv)
    sides = [s for s in (x.strip() for x in args.sides.split(",")) if s]
    unknown = [s for s in sides if s not in SIDES]
    if unknown or not sides:
        raise SystemExit(f"--sides: unknown {unknown}; choose from {', '.join(SIDES)}")
    if not args.ray_serve_llm:
        sides = [s for s in sides if s != "ray-serve-llm"]
    if args.with_classes_fcfs and "shunter-classes-fcfs" not in sides:
        sides.append("shunter-classes-fcfs")
    d = Durations().scaled(0.25) if args.quick else Durations()
    d = replace(d, **{k: v for k, v in vars(args).items() if k in asdict(d) and v is not None})
    if d.settle_s >= d.flood_alone_s or d.settle_s >= d.flood_s or d.shares_settle_s >= d.shares_s:
        raise SystemExit("a phase's settle time must be shorter than the phase")
    w = Workload(flood_streams=args.flood_streams, share_streams=_pair(args.share_streams, int, "--share-streams"),
                 share_weights=_pair(args.share_weights, float, "--share-weights"), overload=args.overload,
                 target_interactive_s=args.target_interactive, target_batch_s=args.target_batch, seed=args.seed)
    return args, sides, d, w


def main(argv: list[str] | None = None) -> int:
    args, sides, d, w = options(argv)
    from shunter.bench.runner import environment
    from shunter.cli.bench_contention_report import cpu_info, report

    result = measure(args.config, args.model, sides, d, w, args.capacity, not args.default_deadlines, args.out)
    env = environment()
    result = {"benchmark": "contention", **result, "quick": args.quick, **env, "cpu": cpu_info()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("\n" + report(result))
    print(f"\nwritten to {args.out} ({result['wall_s']:.0f} s)")
    return 0
