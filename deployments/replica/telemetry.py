"""What a ModelServer replica reports about itself: its engine's gauges and counters (exported through
Ray's metrics every few seconds) and the spans of the requests it serves.

Engine metrics come from vLLM's own scheduler stats (`shunter.engine.EngineCounters`): KV-cache usage,
running and waiting requests, and prefix-cache lookups and hits (as counters, so a dashboard can take a
hit rate over any window); LoRA adapter loads (per adapter), their seconds, and the adapters held.
Labels: model, version, replica (and adapter). Each is read through the engine's declared interface
(`shunter.engine_protocol.ServingEngine`: `counters`, `adapters`, `prefix_view`, None when it lacks them).

Spans: the replica's span continues the gateway's trace (the W3C carrier in `ReplicaRequest.trace`);
the engine's generation is a child span whose `first_token` event marks the first chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shunter import tracing
from shunter.engine_protocol import ServingEngine
from shunter.metric_catalog import build
from shunter.ray_metrics import LazyMetrics

log = logging.getLogger("ray.serve")

EXPORT_PERIOD_S = 5.0
_NAMES = ("shunter_engine_kv_cache_usage_ratio", "shunter_engine_prefix_cache_queries_total",
          "shunter_engine_prefix_cache_hits_total", "shunter_engine_requests_running",
          "shunter_engine_requests_waiting", "shunter_adapter_loads_total", "shunter_adapter_load_seconds_total",
          "shunter_adapters_held", "shunter_prefix_view_blocks", "shunter_prefix_view_held_keys",
          "shunter_kv_event_lag_seconds", "shunter_kv_event_losses_total", "shunter_replica_start_seconds")
_get = LazyMetrics(lambda metrics: build(metrics, _NAMES)).get


def record_start(clock: Any, tags: dict[str, str], replica: str) -> None:
    """A replica's start, phase by phase (shunter.engine.PhaseClock): one histogram observation per phase
    and one for the total, and a `replica.start` span whose children are the phases, at their real times
    (the span is made after the fact: tracing may only be set up part way through the start)."""
    total = sum(clock.phases.values())
    m = _get()
    if m:
        for phase, seconds in [*clock.phases.items(), ("total", total)]:
            m["shunter_replica_start_seconds"].observe(seconds, tags={**tags, "phase": phase})
    tracer = tracing.tracer()
    ns = 1_000_000_000
    at = clock.started
    root = tracer.start_span("replica.start", start_time=int(at * ns),
                             attributes={"shunter.model": tags["model"], "shunter.version": tags["version"],
                                         "shunter.replica": replica, "shunter.start_seconds": total})
    with trace.use_span(root, end_on_exit=False):
        for phase, seconds in clock.phases.items():
            tracer.start_span(f"replica.start.{phase}", start_time=int(at * ns)).end(end_time=int((at + seconds) * ns))
            at += seconds
    root.end(end_time=int(at * ns))
    log.info("replica %s of %s started in %.1f s: %s", replica, tags["model"], total,
             ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in clock.phases.items()))


class EngineMetrics:
    """Exports one replica's engine stats; `run()` is the replica's background task."""

    def __init__(self, engine: ServingEngine, model: str, version: str, replica: str):
        self.engine = engine
        self.tags = {"model": model, "version": version, "replica": replica}
        self._sent_queries = self._sent_hits = 0
        self._sent_loads: dict[str, int] = {}
        self._sent_load_seconds = 0.0
        self._sent_losses = 0

    def export_once(self) -> None:
        counters = self.engine.counters
        m = _get()
        if counters is None or not m:
            return
        m["shunter_engine_kv_cache_usage_ratio"].set(counters.kv_cache_usage, tags=self.tags)
        m["shunter_engine_requests_running"].set(counters.running, tags=self.tags)
        m["shunter_engine_requests_waiting"].set(counters.waiting, tags=self.tags)
        queries, hits = counters.prefix_cache_queries, counters.prefix_cache_hits
        if queries > self._sent_queries:
            m["shunter_engine_prefix_cache_queries_total"].inc(queries - self._sent_queries, tags=self.tags)
            self._sent_queries = queries
        if hits > self._sent_hits:
            m["shunter_engine_prefix_cache_hits_total"].inc(hits - self._sent_hits, tags=self.tags)
            self._sent_hits = hits
        adapters = self.engine.adapters
        if adapters is not None:
            self._export_adapters(m, adapters)
        view = self.engine.prefix_view
        if view is not None:
            self._export_prefix_view(m, view.summary())

    def _export_prefix_view(self, m: dict[str, Any], view: dict[str, Any]) -> None:
        """Precise prefix routing's view of this engine (shunter.kv_events): its size and the events' health."""
        m["shunter_prefix_view_blocks"].set(view["blocks"], tags=self.tags)
        m["shunter_prefix_view_held_keys"].set(view["held_keys"], tags=self.tags)
        m["shunter_kv_event_lag_seconds"].set(view["last_lag_s"], tags=self.tags)
        losses = view.get("losses", 0)
        if losses > self._sent_losses:
            m["shunter_kv_event_losses_total"].inc(losses - self._sent_losses, tags=self.tags)
            self._sent_losses = losses

    def _export_adapters(self, m: dict[str, Any], adapters: Any) -> None:
        m["shunter_adapters_held"].set(len(adapters.held()), tags=self.tags)
        for name, loads in list(adapters.loads.items()):
            if loads > self._sent_loads.get(name, 0):
                m["shunter_adapter_loads_total"].inc(loads - self._sent_loads.get(name, 0),
                                                     tags={**self.tags, "adapter": name})
                self._sent_loads[name] = loads
        if adapters.load_seconds > self._sent_load_seconds:
            m["shunter_adapter_load_seconds_total"].inc(adapters.load_seconds - self._sent_load_seconds,
                                                        tags=self.tags)
            self._sent_load_seconds = adapters.load_seconds

    async def run(self, period_s: float = EXPORT_PERIOD_S) -> None:
        while True:
            try:
                self.export_once()
            except Exception:  # noqa: BLE001 - metrics never take a replica down
                log.debug("engine metrics export failed", exc_info=True)
            await asyncio.sleep(period_s)


async def traced(items: AsyncIterator[Any], carrier: dict[str, str], endpoint: str, model: str, version: str,
                 replica: str) -> AsyncIterator[Any]:
    """Relay a replica's reply items inside its span (a child of the gateway's routing span). The first
    item after `Accepted` and the reply head marks the first token."""
    parent = tracing.context_from(carrier)
    span = tracing.tracer().start_span(f"replica {endpoint}", context=parent, kind=SpanKind.SERVER,
                                       attributes={"shunter.model": model, "shunter.version": version,
                                                   "shunter.replica": replica})
    generate = tracing.tracer().start_span("engine.generate", context=trace.set_span_in_context(span))
    seen = 0
    ok = True
    try:
        with trace.use_span(span, end_on_exit=False):
            async for item in items:
                seen += 1
                if seen == 2 and isinstance(item, dict):  # the reply head
                    generate.set_attribute("http.response.status_code", item.get("status", 0))
                    if not item.get("stream"):
                        generate.add_event("first_token")  # a whole reply: first and last at once
                elif seen == 3:
                    generate.add_event("first_token")
                yield item
    except BaseException as exc:
        ok = False
        generate.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        generate.set_attribute("shunter.chunks", max(0, seen - 2))
        generate.end()
        if not ok:
            span.set_status(Status(StatusCode.ERROR))
        span.end()
