"""One request's typed context: created once at the door, read by everything after it.

The door (shunter.deployments.gateway.forward) builds a `RequestContext` from the caller's key, the
endpoint's descriptor (shunter.endpoints) and the request as vLLM's own model parsed it; then it records
on the context what is decided about the request on its way: the model, version and LoRA adapter chosen,
the limits applied, the quota ticket, the admission slot, the replica that answered, the tokens used so far
(`Usage`), and finally its `Outcome`. Nothing downstream re-parses the body: the body the engine gets is
built once, here (`engine_body`), from the parsed request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from shunter.auth import Caller
from shunter.config import DEFAULT_VERSION, ModelConfig
from shunter.endpoints import Endpoint, ParsedRequest
from shunter.replica_protocol import AdapterRoute, RequestLimits, Working
from shunter.routing.tiers import Decision
from shunter.wire_formats import cached_prompt_tokens, whole_usage

CLIENT_GONE = 499  # the client closed the connection first (nginx's name for it)
STREAM_ERROR = "stream_error"  # the status a 200 stream that ended with an error event is counted under


class Ending(Enum):
    """How a request ended: each ending is one way the enumerating unit test drives a request."""

    SERVED = "served"  # the client got the whole answer (a 2xx, or a replica's own 4xx: its verdict)
    REFUSED = "refused"  # the gateway said no before any replica served it (4xx, 429, 503)
    TIMED_OUT = "timed_out"  # past the request timeout (504), or a stream cut at its deadline or idle limit
    CLIENT_GONE = "client_gone"  # the client left first (499): the replica's work is cancelled
    ENGINE_ERROR = "engine_error"  # the replica failed: it broke mid-stream or reported an engine error
    DRAINED = "drained"  # its replica left (scale-down, update) and the drain timeout cut the stream
    GATEWAY_ERROR = "gateway_error"  # a bug in the gateway (500)


@dataclass(frozen=True)
class Outcome:
    """A request's single typed outcome, recorded once when it ends. `status`: what the client saw (a
    stream that started as 200 and ended badly: `stream_error`; a client that left: 499). `finished`: the
    replica's work ended by itself (else it is cancelled). `why`: for the replica's breaker, when the
    ending is the replica's failure."""

    ending: Ending
    status: int | str
    finished: bool = True
    why: str = ""

    @property
    def version_ok(self) -> bool | None:
        """For the rollout gates: served whole (True), broke (False), or None when the ending says nothing
        about the version (a client error, the client gone, a limit, a drain)."""
        if self.ending is Ending.SERVED:
            return True
        return False if self.ending is Ending.ENGINE_ERROR else None

    @property
    def replica_failed(self) -> bool | None:
        """For the answering replica's breaker: failed (True), answered (False), or None: says nothing."""
        if self.ending is Ending.ENGINE_ERROR:
            return True
        return False if self.ending is Ending.SERVED else None


def served(status: int) -> Outcome:
    return Outcome(Ending.SERVED, status)


def refused(status: int) -> Outcome:
    return Outcome(Ending.REFUSED, status, finished=False)


def client_gone() -> Outcome:
    return Outcome(Ending.CLIENT_GONE, CLIENT_GONE, finished=False)


@dataclass
class Usage:
    """The tokens a request has used so far, as the engine counted them: a whole reply's usage, a stream's
    running usage, or a whole reply's last `Working` heartbeat (what a client that leaves is charged)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens the engine had cached, where its usage says
    in_engine: tuple[int, int] = (0, 0)  # (prompt, completion) at a whole reply's last heartbeat

    def working(self, progress: Working) -> None:
        self.in_engine = (progress.prompt_tokens, progress.completion_tokens)

    def new_attempt(self) -> None:
        self.in_engine = (0, 0)  # what an earlier attempt's replica produced is not this one's

    def whole_reply(self, body: Any) -> None:
        usage = whole_usage(body)
        self.cached_tokens = cached_prompt_tokens(body.get("usage") if isinstance(body, dict) else None)
        if usage is not None:
            self.prompt_tokens, self.completion_tokens = usage

    def client_left(self) -> None:
        """Charged what the engine had produced by then, never the whole reservation."""
        self.prompt_tokens = max(self.prompt_tokens, self.in_engine[0])
        self.completion_tokens = max(self.completion_tokens, self.in_engine[1])


@dataclass
class RequestContext:
    """One request, from the door to its outcome; see the module docstring."""

    endpoint: Endpoint
    parsed: ParsedRequest
    model: ModelConfig
    request_id: str  # Serve's id (the client's X-Request-ID or the proxy's): logs, spans, the client
    caller: Caller | None = None  # None: the platform's own request (the tier monitor)
    adapter: AdapterRoute | None = None  # the LoRA adapter asked for, and its version under rollout
    tier: Decision | None = None  # `model: auto`: the tier chosen
    session: str | None = None  # the conversation (keeps its version)
    priority_class: str = ""  # its flow-control class (shunter.deployments.gateway.flow.priority); "" for our own
    price_multiplier: float = 1.0  # its class's, on the model's pricing (flow_control.classes[].price_multiplier)
    engine_body: dict[str, Any] = field(default_factory=dict)  # the body as the engine gets it
    limits: RequestLimits = field(default_factory=RequestLimits)
    ticket: Any = None  # the caller's quota reservation (shunter.deployments.gateway.access.Ticket)
    version: str = DEFAULT_VERSION
    usage: Usage = field(default_factory=Usage)
    outcome: Outcome | None = None
    # The routers' bookkeeping key: unique per request, whatever X-Request-ID a client sends.
    routing_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # The usage ledger's id for it when not `routing_id`: a batch's line is one charge however often it ran.
    ledger_id: str | None = None
    began: float = field(default_factory=time.monotonic)
    # Called once when the request ends, after the platform's own hooks (the tier monitor's comparison).
    on_outcome: list[Callable[[RequestContext], None]] = field(default_factory=list)


def engine_body(parsed: ParsedRequest, engine_name: str, cache_salt: str | None,
                priority: int | None = None, served_tier: str | None = None) -> dict[str, Any]:
    """The body the engine gets, built once from the parsed request: the canonical model name the engine
    knows, the tenant's cache salt where the prompt reaches the prefix cache, the scheduling `priority` of
    its class for an engine that schedules by priority (`priority`; never the client's own), and on
    OpenAI's APIs the `service_tier` its class is served at in place of the one asked for (`auto` among
    them): the replica writes it into every reply and chunk, and vLLM's Responses echoes it. A stream's
    usage is the replica's to count (shunter.deployments.replica.stream_reader): its options stay the
    client's, their flags as the parsed request read them (`"false"` is false), so the replica, which reads
    the body it gets, decides on typed values."""
    body = {**parsed.body, "model": engine_name}
    endpoint = parsed.endpoint
    if endpoint.engine_priority:
        body.pop("priority", None)
        if priority is not None:
            body["priority"] = priority
    if endpoint.tenant_cache and cache_salt is not None:
        body["cache_salt"] = cache_salt
    if endpoint.tier_vocabulary == "openai" and served_tier is not None:
        body["service_tier"] = served_tier
    options = body.get("stream_options")
    if parsed.stream and isinstance(options, dict):
        body["stream_options"] = {**options, "include_usage": parsed.usage_chunk,
                                  "continuous_usage_stats": parsed.continuous_usage}
    return body
