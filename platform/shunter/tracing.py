"""OpenTelemetry tracing and log correlation for Shunter's processes (gateway and model replicas).

One trace per request: the gateway's server span (its parent is the client's W3C `traceparent` when the
request carries one), a routing span under it, and in the replica process a span for the replica's
work with the engine's generation under it (the first token is an event). The trace context crosses
the Ray handle call inside `ReplicaRequest.trace`, as a W3C carrier dict.

Every process configures its tracer provider once, from the application's `observability.tracing`.
With the exporter `none` nothing is installed and every span is OpenTelemetry's no-op span, so the
request path costs nothing extra.

Logs: `CorrelationFilter` adds the current `trace_id` and `span_id` to every record of the Serve
logger, so Ray Serve's JSON logs carry them beside Serve's own `request_id`.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shunter.config import TracingConfig

TRACER_NAME = "shunter"
_propagator = TraceContextTextMapPropagator()
_lock = threading.Lock()
_configured: str | None = None  # the exporter this process was set up with


def setup_tracing(config: TracingConfig, component: str) -> None:
    """Install this process's tracer provider (once; later calls with another exporter are ignored,
    as OpenTelemetry allows one global provider per process)."""
    global _configured
    with _lock:
        if _configured is not None:
            return
        _configured = config.exporter
        if config.exporter == "none":
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        resource = Resource.create({"service.name": config.service_name, "shunter.component": component,
                                    "process.pid": os.getpid()})
        provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        if config.exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", config.otlp_endpoint)
            exporter: Any = OTLPSpanExporter(endpoint=endpoint)
        else:
            exporter = ConsoleSpanExporter()
        # Spans leave within a second: a replica may be stopped soon after it served.
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
        trace.set_tracer_provider(provider)


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def extract(headers: Any) -> otel_context.Context:
    """The client's trace context from its request headers (W3C `traceparent`/`tracestate`), if any."""
    return _propagator.extract(carrier={k.lower(): v for k, v in headers.items()})


def inject() -> dict[str, str]:
    """The current span's context as a W3C carrier, to hand to another process."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier


def context_from(carrier: dict[str, str] | None) -> otel_context.Context:
    return _propagator.extract(carrier=carrier or {})


def trace_id_hex(span: trace.Span | None = None) -> str | None:
    ctx = (span or trace.get_current_span()).get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


class CorrelationFilter(logging.Filter):
    """Adds `trace_id` and `span_id` of the current span to each record (structured logs show them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            record.trace_id = format(ctx.trace_id, "032x")
            record.span_id = format(ctx.span_id, "016x")
        return True


def correlate_logs(logger_name: str = "ray.serve") -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, CorrelationFilter) for f in logger.filters):
        logger.addFilter(CorrelationFilter())
