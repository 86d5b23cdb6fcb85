"""What the gateway measures about each request: Prometheus metrics (through Ray's exporter) and the
request's OpenTelemetry spans.

`RequestTelemetry` follows one request from its arrival to its last byte. The gateway tells it when the
request was admitted, which version and replica took it, when the first token and every later chunk
were relayed, and how it ended; it records:
- `shunter_requests_total{model,version,endpoint,status}` once, with the HTTP status the client got (or
  `stream_error` when a 200 stream ended with an error event);
- TTFT (arrival to first token chunk, or to the whole reply when not streamed), inter-token gaps and
  end-to-end latency, as histograms with LLM-sized buckets (`shunter.metric_catalog`);
- prompt and completion tokens, as the request's `Usage` counted them (shunter.deployments.gateway.context:
  the engine's usage of a whole reply, a stream's running usage the replica counted beside its chunks, a whole reply's
  last heartbeat when its client left first);
- per-process gauges of requests in flight per version and waiting for a replica per model;
- flow control (issue 38), by model, priority class and tenant (the key's name; "" without keys): the
  requests waiting in this gateway's flow queue (`shunter_flow_queued`), how long each waited there for its
  turn (`shunter_flow_wait_seconds`), and the ones that never got a turn, by reason
  (`shunter_flow_refusals_total`: the key's quota, rate_limit_exceeded or request_exceeds_quota; queue_full,
  queue_timeout, cold_start_timeout, client_left, request_timeout);
- for a request to a LoRA adapter, `shunter_adapter_requests_total{model,adapter,status}` and its tokens
  (the span carries `shunter.adapter`).

The metrics are process-local Ray metrics: each gateway replica exports its own series, and dashboards
sum them. Metrics and spans never break a request: every recording call swallows its own failure. A stream's
usage and in-band error come beside its chunks (shunter.deployments.gateway.stream_account); this module only
times the chunks that brought tokens, as it is told of them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shunter import tracing
from shunter.deployments.gateway.context import RequestContext
from shunter.metric_catalog import build
from shunter.ray_metrics import LazyMetrics

log = logging.getLogger("ray.serve")

_NAMES = ("shunter_requests_total", "shunter_time_to_first_token_seconds", "shunter_inter_token_latency_seconds",
          "shunter_e2e_request_latency_seconds", "shunter_prompt_tokens_total", "shunter_completion_tokens_total",
          "shunter_requests_in_flight", "shunter_requests_queued", "shunter_replicas_routable",
          "shunter_adapter_requests_total", "shunter_adapter_tokens_total", "shunter_flow_queued",
          "shunter_flow_wait_seconds", "shunter_flow_refusals_total")
_record = LazyMetrics(lambda metrics: build(metrics, _NAMES)).record

# This process's gauges, as counts: Ray gauges are set, not incremented.
_in_flight: Counter[tuple[str, str]] = Counter()
_queued: Counter[str] = Counter()
_flow_queued: Counter[tuple[str, str, str]] = Counter()  # (model, priority class, tenant)


def replicas_routable(model: str, version: str, count: int) -> None:
    _record(lambda m: m["shunter_replicas_routable"].set(count, tags={"model": model, "version": version}))


class RequestTelemetry:
    """One request's metrics and spans; see the module docstring."""

    def __init__(self, ctx: RequestContext, headers: Any, log_prompt: str | None = None, label: str | None = None):
        """`label`: the endpoint label of its metrics when not its API's name (`tier_monitor`)."""
        self.ctx = ctx
        self.model, self.endpoint = ctx.model.name, label or ctx.endpoint.name
        self.first_token_at: float | None = None
        self.streamed = False
        self.last_chunk_at: float | None = None
        self.replica: str | None = None
        self._queued = False
        self._flow = (self.model, ctx.priority_class, ctx.caller.name if ctx.caller is not None else "")
        self._flow_since: float | None = None  # when it began waiting in the flow queue, while it waits
        self._flying = False
        self._flying_version = ctx.version
        self._done = False
        self._itl: list[float] = []
        operation = ctx.endpoint.operation
        self.span = tracing.tracer().start_span(
            f"{operation} {self.model}", context=tracing.extract(headers), kind=SpanKind.SERVER,
            attributes={"gen_ai.operation.name": operation, "gen_ai.request.model": self.model,
                        "shunter.request_id": ctx.request_id, "http.route": ctx.endpoint.path,
                        "shunter.priority_class": ctx.priority_class})
        if log_prompt is not None:
            self.span.set_attribute("shunter.prompt", log_prompt[:4096])
        route = ctx.adapter
        if route is not None:
            self.span.set_attributes({"shunter.adapter": route.name, "gen_ai.request.model": route.name})
            if route.version is not None:
                self.span.set_attribute("shunter.adapter_version", route.version)
        self._route_span: trace.Span | None = None

    @property
    def trace_id(self) -> str | None:
        return tracing.trace_id_hex(self.span)

    def use(self) -> Any:
        """Context manager making the server span current (log records then carry its trace id)."""
        return trace.use_span(self.span, end_on_exit=False)

    # ---- the path of the request ------------------------------------------------------------------

    def admitted(self) -> None:
        self._queued = True
        _queued[self.model] += 1
        self._set_queued()
        self._flow_since = time.monotonic()
        _flow_queued[self._flow] += 1
        self._set_flow_queued()

    def turn(self) -> None:
        """The flow queue let it go to the replicas."""
        since = self._leave_flow()
        if since is not None:
            wait, (model, cls, tenant) = time.monotonic() - since, self._flow
            _record(lambda m: m["shunter_flow_wait_seconds"].observe(
                wait, tags={"model": model, "priority_class": cls, "key_name": tenant}))

    def refused(self, reason: str) -> None:
        """It never got a turn: refused by its key's quota (rate_limit_exceeded, request_exceeds_quota) or at
        admission (queue_full), its wait ran out (queue_timeout,
        cold_start_timeout), its client left while it waited (client_left), or the request timeout passed
        (request_timeout)."""
        self._leave_flow()
        model, cls, tenant = self._flow
        _record(lambda m: m["shunter_flow_refusals_total"].inc(
            1, tags={"model": model, "priority_class": cls, "key_name": tenant, "reason": reason}))

    def routing(self, version: str, attempt: int) -> dict[str, str]:
        """A routing attempt on `version` starts; returns the trace carrier for the replica."""
        self._end_route(None)
        self._route_span = tracing.tracer().start_span(
            "route", context=trace.set_span_in_context(self.span),
            attributes={"shunter.model": self.model, "shunter.version": version, "shunter.attempt": attempt})
        with trace.use_span(self._route_span, end_on_exit=False):
            return tracing.inject()

    def accepted(self, replica: str) -> None:
        """A replica took the request: it no longer waits in this gateway."""
        self.replica = replica
        if self._route_span is not None:
            self._route_span.set_attribute("shunter.replica", replica)
        self._leave_queue()
        if not self._flying:
            self._flying, self._flying_version = True, self.ctx.version
            _in_flight[(self.model, self._flying_version)] += 1
            self._set_in_flight()

    def attempt_failed(self, why: str) -> None:
        self._end_route(why)
        self._land()  # the replica failed before the first byte: the retry is a new flight

    def answered(self) -> None:
        """The reply's head (and for a stream its first chunk) is here: routing is over."""
        self._end_route(None)
        self.span.set_attributes({"shunter.version": self.ctx.version, "shunter.replica": self.replica or ""})

    def token(self, now: float) -> None:
        """A chunk that brought tokens arrived (told by the stream account): TTFT and the inter-token gaps."""
        self.streamed = True
        if self.first_token_at is None:
            self.first_token_at = now
            self.span.add_event("first_token")
        elif self.last_chunk_at is not None:
            self._itl.append(now - self.last_chunk_at)
        self.last_chunk_at = now

    def whole_reply(self) -> None:
        """A non-streamed reply: its arrival is the first (and last) token."""
        self.first_token_at = time.monotonic()

    def finish(self, status: int | str) -> None:
        """The request is over, with the status the client saw. Called once; later calls do nothing."""
        if self._done:
            return
        self._done = True
        if self._flow_since is not None:  # still waiting for its turn: the client left, or the request timed out
            self.refused("client_left" if str(status) == "499" else "request_timeout")
        self._leave_queue()
        self._end_route(None)
        self._land()
        end = time.monotonic()
        status = str(status)
        ctx, usage = self.ctx, self.ctx.usage
        prompt_tokens, completion_tokens = usage.prompt_tokens, usage.completion_tokens
        tags = {"model": self.model, "version": ctx.version}
        began = ctx.began

        def record(m: dict[str, Any]) -> None:
            m["shunter_requests_total"].inc(1, tags={**tags, "endpoint": self.endpoint, "status": status})
            if status.startswith("2"):
                by_endpoint = {**tags, "endpoint": self.endpoint}
                m["shunter_e2e_request_latency_seconds"].observe(end - began, tags=by_endpoint)
                if self.streamed and self.first_token_at is not None:
                    m["shunter_time_to_first_token_seconds"].observe(self.first_token_at - began,
                                                                     tags=by_endpoint)
                for gap in self._itl:
                    m["shunter_inter_token_latency_seconds"].observe(gap, tags=by_endpoint)
            if prompt_tokens:
                m["shunter_prompt_tokens_total"].inc(prompt_tokens, tags=tags)
            if completion_tokens:
                m["shunter_completion_tokens_total"].inc(completion_tokens, tags=tags)
            if ctx.adapter is not None:
                by_adapter = {"model": self.model, "adapter": ctx.adapter.name}
                m["shunter_adapter_requests_total"].inc(1, tags={**by_adapter, "status": status})
                if prompt_tokens or completion_tokens:
                    m["shunter_adapter_tokens_total"].inc(prompt_tokens + completion_tokens, tags=by_adapter)

        _record(record)
        try:
            self.span.set_attributes({"http.response.status_code": status, "shunter.version": ctx.version,
                                      "gen_ai.usage.input_tokens": prompt_tokens,
                                      "gen_ai.usage.output_tokens": completion_tokens})
            if not status.startswith("2"):
                self.span.set_status(Status(StatusCode.ERROR, status))
            self.span.end()
        except Exception:  # noqa: BLE001 - tracing never breaks a request
            log.debug("span end failed", exc_info=True)

    # ---- internals --------------------------------------------------------------------------------------

    def _land(self) -> None:
        if self._flying:
            self._flying = False
            _in_flight[(self.model, self._flying_version)] -= 1
            self._set_in_flight(self._flying_version)

    def _leave_queue(self) -> None:
        if self._queued:
            self._queued = False
            _queued[self.model] -= 1
            self._set_queued()

    def _leave_flow(self) -> float | None:
        since, self._flow_since = self._flow_since, None
        if since is not None:
            _flow_queued[self._flow] -= 1
            self._set_flow_queued()
        return since

    def _set_flow_queued(self) -> None:
        count, (model, cls, tenant) = _flow_queued[self._flow], self._flow
        _record(lambda m: m["shunter_flow_queued"].set(
            count, tags={"model": model, "priority_class": cls, "key_name": tenant}))

    def _end_route(self, failure: str | None) -> None:
        span, self._route_span = self._route_span, None
        if span is None:
            return
        if failure:
            span.set_status(Status(StatusCode.ERROR, failure))
        span.end()

    def _set_queued(self) -> None:
        count = _queued[self.model]
        _record(lambda m: m["shunter_requests_queued"].set(count, tags={"model": self.model}))

    def _set_in_flight(self, version: str | None = None) -> None:
        version = version or self._flying_version
        count = _in_flight[(self.model, version)]
        _record(lambda m: m["shunter_requests_in_flight"].set(count, tags={"model": self.model, "version": version}))

