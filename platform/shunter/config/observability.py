"""`observability:`: tracing and logging (metrics need no settings)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shunter.config.base import StrictModel


class TracingConfig(StrictModel):
    """OpenTelemetry traces: one trace per request across gateway, routing, replica and engine."""

    exporter: Literal["none", "console", "otlp"] = Field(
        default="none",
        description="Where spans go: none (tracing off), console (JSON on each process's stdout, for "
        "debugging), otlp (OTLP over HTTP to `otlp_endpoint`: an OpenTelemetry Collector, Tempo, Jaeger).",
    )
    otlp_endpoint: str = Field(
        default="http://127.0.0.1:4318/v1/traces",
        description="otlp only: the collector's OTLP/HTTP traces URL. $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
        "when set in the processes' environment, wins.",
    )
    sample_ratio: float = Field(
        default=1.0, ge=0.0, le=1.0,
        description="Share of new traces recorded. A request that arrives with a sampled W3C `traceparent` "
        "is always recorded (the client's decision stands).",
    )
    service_name: str = Field(default="shunter", description="`service.name` of every span's resource.")


class LoggingConfig(StrictModel):
    """How the gateway and the model replicas log."""

    format: Literal["json", "text"] = Field(
        default="json",
        description="json: one JSON object per line (Ray Serve's structured logs) carrying the request id "
        "and trace id; text: Ray's plain format.",
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="Log level.")
    log_prompts: bool = Field(
        default=False,
        description="Whether prompts and generated text may appear in logs and span attributes. Off by "
        "default: prompts are user data.",
    )


class ObservabilityConfig(StrictModel):
    """Traces and logs (metrics are always on: they go through Ray's exporter)."""

    tracing: TracingConfig = Field(default_factory=TracingConfig, description="OpenTelemetry tracing.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Structured logs.")
