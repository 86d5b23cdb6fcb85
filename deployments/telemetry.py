"""What the gateway measures about each request: Prometheus metrics (through Ray's exporter) and the
request's OpenTelemetry spans.

`RequestTelemetry` follows one request from its arrival to its last byte. The gateway tells it when the
request was admitted, which version and replica took it, when the first token and every later chunk
were relayed, and how it ended; it records:
- `shunter_requests_total{model,version,endpoint,status}` once, with the HTTP status the client got (or
  `stream_error` when a 200 stream ended with an error event);
- TTFT (arrival to first token chunk, or to the whole reply when not streamed), inter-token gaps and
  end-to-end latency, as histograms with LLM-sized buckets (`shunter.metric_catalog`);
- prompt and completion tokens from the engine's `usage` (the gateway asks the engine for a usage
  chunk on every stream and drops it again when the client did not ask for one); for a whole reply
  whose client left first, what its replica's last heartbeat said it had produced;
- per-process gauges of requests in flight per version and waiting for a replica per model;
- for a request to a LoRA adapter, `shunter_adapter_requests_total{model,adapter,status}` and its tokens
  (the span carries `shunter.adapter`).

The metrics are process-local Ray metrics: each gateway replica exports its own series, and dashboards
sum them. Metrics and spans never break a request: every recording call swallows its own failure.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shunter import tracing
from shunter.deployments.wire_formats import EVENT_APIS, cached_prompt_tokens, read_event, whole_usage
from shunter.metric_catalog import build
from shunter.ray_metrics import LazyMetrics
from shunter.replica_protocol import AdapterRoute, Working

log = logging.getLogger("ray.serve")

STREAM_ERROR = "stream_error"
_NAMES = ("shunter_requests_total", "shunter_time_to_first_token_seconds", "shunter_inter_token_latency_seconds",
          "shunter_e2e_request_latency_seconds", "shunter_prompt_tokens_total", "shunter_completion_tokens_total",
          "shunter_requests_in_flight", "shunter_requests_queued", "shunter_replicas_routable",
          "shunter_adapter_requests_total", "shunter_adapter_tokens_total")
_record = LazyMetrics(lambda metrics: build(metrics, _NAMES)).record
_OPERATION = {"chat": "chat", "completion": "text_completion", "embedding": "embeddings", "responses": "chat",
              "messages": "chat"}

# This process's gauges, as counts: Ray gauges are set, not incremented.
_in_flight: Counter[tuple[str, str]] = Counter()
_queued: Counter[str] = Counter()


def replicas_routable(model: str, version: str, count: int) -> None:
    _record(lambda m: m["shunter_replicas_routable"].set(count, tags={"model": model, "version": version}))


def ask_for_usage(body: dict[str, Any], endpoint: str = "chat") -> dict[str, Any]:
    """The body to send to the engine (`stream` already parsed to a bool): a stream carries its running
    usage on every chunk and ends with a usage chunk, so every token is counted, however it ends. (The
    Responses and Messages APIs have no such option: their streams end with the usage.)"""
    if body.get("stream") is not True or endpoint in EVENT_APIS:
        return body
    options = body.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options.update(include_usage=True, continuous_usage_stats=True)
    return {**body, "stream_options": options}


class RequestTelemetry:
    """One request's metrics and spans; see the module docstring."""

    def __init__(self, model: str, endpoint: str, headers: Any, request_id: str, client_wants_usage: bool = False,
                 log_prompt: str | None = None, continuous_usage: bool = False):
        self.model, self.endpoint, self.request_id = model, endpoint, request_id
        # The routers' bookkeeping key: unique per request, whatever X-Request-ID a client sends (Serve
        # takes the client's id as the request id, so two requests may share one).
        self.routing_id = uuid.uuid4().hex
        self.client_wants_usage = client_wants_usage
        self.client_wants_continuous_usage = continuous_usage
        self.version = "default"
        self.began = time.monotonic()
        self.first_token_at: float | None = None
        self.streamed = False
        self.last_chunk_at: float | None = None
        self.prompt_tokens = self.completion_tokens = 0
        self.cached_tokens: int | None = None  # prompt tokens the engine had cached, where its usage says
        self.replica: str | None = None
        self._queued = False
        self._flying = False
        self._done = False
        self._itl: list[float] = []
        self.span = tracing.tracer().start_span(
            f"{_OPERATION.get(endpoint, endpoint)} {model}", context=tracing.extract(headers), kind=SpanKind.SERVER,
            attributes={"gen_ai.operation.name": _OPERATION.get(endpoint, endpoint), "gen_ai.request.model": model,
                        "shunter.request_id": request_id, "http.route": f"/v1/{endpoint}"})
        if log_prompt is not None:
            self.span.set_attribute("shunter.prompt", log_prompt[:4096])
        self._route_span: trace.Span | None = None
        # Called once at the end with (status, prompt tokens, completion tokens): the caller's quota.
        self.on_finish: list[Callable[[int | str, int, int], None]] = []
        self.choices_per_prompt = 1  # `n`: a completions batch numbers its choices prompt by prompt
        # Running usage of a stream, from the engine's per-chunk usage: per choice index, the completion
        # tokens so far; per prompt, its prompt tokens. A stream cut short is settled at these.
        self._completion_by_choice: dict[int, int] = {}
        self._prompt_by_prompt: dict[int, int] = {}
        # An error event inside a 200 stream (vLLM reports an engine failure mid-stream in-band, then
        # [DONE]): its `error` object, for the relay to count as the replica's failure.
        self.in_band_error: dict[str, Any] | None = None
        self._final_usage = False  # a typed-event stream's usage event has arrived
        # What a whole reply had produced in the engine when its replica last said so (its `Working`
        # heartbeats): (prompt, completion) tokens. A request whose client left is settled at these.
        self._in_engine = (0, 0)
        self.adapter: AdapterRoute | None = None  # the LoRA adapter asked for, and its version

    def use_adapter(self, route: AdapterRoute) -> None:
        """The request names a LoRA adapter of the model (its replica loads it from `route.source`)."""
        self.adapter = route
        self.span.set_attributes({"shunter.adapter": route.name, "gen_ai.request.model": route.name})
        if route.version is not None:
            self.span.set_attribute("shunter.adapter_version", route.version)

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

    def routing(self, version: str, attempt: int) -> dict[str, str]:
        """A routing attempt on `version` starts; returns the trace carrier for the replica."""
        self.version = version
        self._in_engine = (0, 0)  # what an earlier attempt's replica produced is not this one's
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
            self._flying = True
            _in_flight[(self.model, self.version)] += 1
            self._set_in_flight()

    def working(self, progress: Working) -> None:
        """The replica's heartbeat while it computes a whole reply: what it has produced so far."""
        self._in_engine = (progress.prompt_tokens, progress.completion_tokens)

    def client_left(self) -> None:
        """The client left before the reply ended: its tokens are what the engine had produced by then, as
        its replica last reported them (a whole reply's heartbeats; a stream has counted its chunks)."""
        prompt, completion = self._in_engine
        self.prompt_tokens = max(self.prompt_tokens, prompt)
        self.completion_tokens = max(self.completion_tokens, completion)

    def attempt_failed(self, why: str) -> None:
        self._end_route(why)
        if self._flying:  # the replica failed before the first byte: the retry is a new flight
            self._flying = False
            _in_flight[(self.model, self.version)] -= 1
            self._set_in_flight()

    def answered(self) -> None:
        """The reply's head (and for a stream its first chunk) is here: routing is over."""
        self._end_route(None)
        self.span.set_attributes({"shunter.version": self.version, "shunter.replica": self.replica or ""})

    def chunk(self, text: str) -> str | None:
        """A stream chunk on its way to the client. Returns it, or None to drop it (the final usage chunk
        the client did not ask for). The platform asks the engine for usage on every chunk (so a stream
        cut short is settled at the tokens it produced); a client that did not ask for that gets its
        chunks without it. Token chunks time TTFT and the inter-token gaps.

        vLLM's chunks are compact JSON with `usage` as their last key; those are read without decoding
        the event (the usage object alone is parsed and cut off the text, so the client gets vLLM's own
        bytes). Any other event (an error, another engine's layout) is decoded whole. The Responses and
        Messages APIs' typed events pass unchanged (`_typed_event`)."""
        if self.endpoint in EVENT_APIS:
            return self._typed_event(text)
        if not text.startswith("data: {"):
            return text
        now = time.monotonic()
        split = _split_usage(text)
        if split is None:
            return self._decoded_chunk(text, now)
        event, usage = split
        index = _first_choice_index(event)
        if index is None:
            if '"choices":[]' not in event:
                return self._decoded_chunk(text, now)
            self._usage(usage)  # the final usage-only chunk: the totals
            return text if self.client_wants_usage else None
        self._running_usage(index, usage)
        self._token_chunk(now)
        return text if self.client_wants_continuous_usage else event

    def _decoded_chunk(self, text: str, now: float) -> str | None:
        data = _event_json(text)
        choices = data.get("choices")
        if not choices and isinstance(data.get("error"), dict):
            self.in_band_error = data["error"]
            return text
        usage = data.get("usage")
        if isinstance(usage, dict):
            if not choices:  # the final usage-only chunk: the totals
                self._usage(usage)
                return text if self.client_wants_usage else None
            first = choices[0] if isinstance(choices[0], dict) else {}
            index = first.get("index", 0)
            if isinstance(index, int):
                self._running_usage(index, usage)
            if not self.client_wants_continuous_usage:
                del data["usage"]
                text = f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"
        if choices:
            self._token_chunk(now)
        return text

    def _typed_event(self, text: str) -> str:
        """A Responses or Messages event: its deltas time the tokens and, until the final usage arrives, are
        counted one token each (what a stream cut short is settled at); usage events carry the engine's
        counts."""
        event = read_event(self.endpoint, text)
        if event.token:
            self._token_chunk(time.monotonic())
            if not self._final_usage:
                self.completion_tokens += 1
        if event.prompt_tokens is not None:
            self.prompt_tokens = event.prompt_tokens
        if event.completion_tokens is not None:
            self.completion_tokens = event.completion_tokens
            self._final_usage = True
        if event.error is not None:
            self.in_band_error = event.error
        return text

    def _token_chunk(self, now: float) -> None:
        self.streamed = True
        if self.first_token_at is None:
            self.first_token_at = now
            self.span.add_event("first_token")
        elif self.last_chunk_at is not None:
            self._itl.append(now - self.last_chunk_at)
        self.last_chunk_at = now

    def whole_reply(self, body: Any) -> None:
        """A non-streamed reply: its arrival is the first (and last) token."""
        self.first_token_at = time.monotonic()
        usage = whole_usage(body)
        self.cached_tokens = cached_prompt_tokens(body.get("usage") if isinstance(body, dict) else None)
        if usage is not None:
            self.prompt_tokens, self.completion_tokens = usage

    def finish(self, status: int | str) -> None:
        """The request is over, with the status the client saw. Called once; later calls do nothing."""
        if self._done:
            return
        self._done = True
        self._leave_queue()
        self._end_route(None)
        if self._flying:
            self._flying = False
            _in_flight[(self.model, self.version)] -= 1
            self._set_in_flight()
        end = time.monotonic()
        status = str(status)
        tags = {"model": self.model, "version": self.version}

        def record(m: dict[str, Any]) -> None:
            m["shunter_requests_total"].inc(1, tags={**tags, "endpoint": self.endpoint, "status": status})
            if status.startswith("2"):
                by_endpoint = {**tags, "endpoint": self.endpoint}
                m["shunter_e2e_request_latency_seconds"].observe(end - self.began, tags=by_endpoint)
                if self.streamed and self.first_token_at is not None:
                    m["shunter_time_to_first_token_seconds"].observe(self.first_token_at - self.began,
                                                                     tags=by_endpoint)
                for gap in self._itl:
                    m["shunter_inter_token_latency_seconds"].observe(gap, tags=by_endpoint)
            if self.prompt_tokens:
                m["shunter_prompt_tokens_total"].inc(self.prompt_tokens, tags=tags)
            if self.completion_tokens:
                m["shunter_completion_tokens_total"].inc(self.completion_tokens, tags=tags)
            if self.adapter is not None:
                by_adapter = {"model": self.model, "adapter": self.adapter.name}
                m["shunter_adapter_requests_total"].inc(1, tags={**by_adapter, "status": status})
                if self.prompt_tokens or self.completion_tokens:
                    m["shunter_adapter_tokens_total"].inc(self.prompt_tokens + self.completion_tokens,
                                                          tags=by_adapter)

        _record(record)
        for callback in self.on_finish:
            try:
                callback(status, self.prompt_tokens, self.completion_tokens)
            except Exception:  # noqa: BLE001 - bookkeeping never breaks a request
                log.warning("request %s: end-of-request callback failed", self.request_id, exc_info=True)
        try:
            self.span.set_attributes({"http.response.status_code": status, "shunter.version": self.version,
                                      "gen_ai.usage.input_tokens": self.prompt_tokens,
                                      "gen_ai.usage.output_tokens": self.completion_tokens})
            if not status.startswith("2"):
                self.span.set_status(Status(StatusCode.ERROR, status))
            self.span.end()
        except Exception:  # noqa: BLE001 - tracing never breaks a request
            log.debug("span end failed", exc_info=True)

    # ---- internals --------------------------------------------------------------------------------------

    def _usage(self, usage: dict[str, Any]) -> None:
        self.cached_tokens = cached_prompt_tokens(usage)
        self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.completion_tokens = int(usage.get("completion_tokens") or 0)

    def _running_usage(self, index: int, usage: dict[str, Any]) -> None:
        """One chunk's running usage (vLLM's `continuous_usage_stats`: the chunk's choice's completion
        tokens so far and its prompt's tokens)."""
        self._completion_by_choice[index] = int(usage.get("completion_tokens") or 0)
        self._prompt_by_prompt[index // max(1, self.choices_per_prompt)] = int(usage.get("prompt_tokens") or 0)
        self.completion_tokens = sum(self._completion_by_choice.values())
        self.prompt_tokens = sum(self._prompt_by_prompt.values())

    def _leave_queue(self) -> None:
        if self._queued:
            self._queued = False
            _queued[self.model] -= 1
            self._set_queued()

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

    def _set_in_flight(self) -> None:
        count = _in_flight[(self.model, self.version)]
        _record(lambda m: m["shunter_requests_in_flight"].set(count, tags={"model": self.model,
                                                                           "version": self.version}))


def choice_text(data: dict[str, Any]) -> str | None:
    """The text of choice 0 in a reply or a stream chunk: a chat message or delta, or a completion's text."""
    for choice in data.get("choices") or ():
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        part = choice.get("delta") or choice.get("message")
        text = part.get("content") if isinstance(part, dict) else choice.get("text")
        return text if isinstance(text, str) else None
    return None


def _event_json(text: str) -> dict[str, Any]:
    """The JSON object of one SSE `data:` event, or {} when it is not one."""
    try:
        data = json.loads(text[len("data: "):])
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


_USAGE_KEY = ',"usage":'
_FIRST_CHOICE = '"choices":[{"index":'


def _split_usage(text: str) -> tuple[str, dict[str, Any]] | None:
    """A compact `data: {..., "usage": {...}}` event as (the event without its usage key, the usage), or
    None when the event does not end with a usage object. A quote inside a JSON string is escaped, so the
    last `,"usage":` of the text is the key itself."""
    cut = text.rfind(_USAGE_KEY)
    if cut < 0 or not text.endswith("}}\n\n"):
        return None
    try:
        usage = json.loads(text[cut + len(_USAGE_KEY):-3])
    except ValueError:  # `usage` was not the last key
        return None
    if not isinstance(usage, dict):
        return None
    return text[:cut] + "}\n\n", usage


def _first_choice_index(event: str) -> int | None:
    """The index of a compact event's first choice, or None when it has no choice in that layout."""
    start = event.find(_FIRST_CHOICE)
    if start < 0:
        return None
    start += len(_FIRST_CHOICE)
    end = start
    while end < len(event) and event[end].isdigit():
        end += 1
    return int(event[start:end]) if end > start else None
