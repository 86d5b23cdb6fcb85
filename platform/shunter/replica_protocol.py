"""What the gateway, the routers and the ModelServer replicas pass each other (pickled by Ray).

A call to a replica's `handle` carries one `ReplicaRequest`: the endpoint, the JSON body, and routing
hints the router reads from the pending request (never the replica): which replicas to avoid (a retry
after a failure) or the one replica to pin to (operator and test calls such as `stats`). Other replica
methods take a bare `RouteHint` as their first argument for the same purpose.

A replica's streamed answer starts with `Accepted(replica_id)` as soon as it takes the request, so the
gateway knows at once which replica serves it (for the breaker, the retry and the `x-shunter-replica`
header) and can bound how long a request waits for any replica to take it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from shunter.endpoints import ENDPOINTS


@dataclass(frozen=True)
class RouteHint:
    """Routing hints for one call; the router honours them, the replica ignores them."""

    request_id: str = ""
    avoid: tuple[str, ...] = ()  # replica ids this request already failed on
    pin: str | None = None  # a replica id this call must go to (stats, drain): no other replica will do


@dataclass(frozen=True)
class AdapterRoute:
    """The LoRA adapter a request goes to. The engine knows each adapter's files by `engine_name`: the
    adapter's own name, or `<name>@<version>` for the other version of an adapter under rollout (two
    versions of one adapter are two entries of the engine's registry); the client sees `name`."""

    name: str
    source: str  # the adapter's directory
    engine_name: str
    version: str | None = None  # under rollout: the version's label (a digest of its directory)


@dataclass(frozen=True)
class RequestLimits:
    """The gateway's limits the replica applies, because only the replica knows the model: its context
    length (a request that names no max_tokens gets at most `max_tokens`, never past the context) and its
    tokenizer (prompts past `max_prompt_tokens` are refused)."""

    max_tokens: int | None = None
    max_prompt_tokens: int | None = None


@dataclass(frozen=True)
class ReplicaRequest(RouteHint):
    """One OpenAI request for a replica. `body` is the parsed JSON, its model already resolved."""

    endpoint: str = "chat"
    body: dict[str, Any] = field(default_factory=dict)
    trace: dict[str, str] = field(default_factory=dict)  # W3C trace context of the gateway's span
    limits: RequestLimits = field(default_factory=RequestLimits)
    # The gateway process's token-channel id (`shunter.deployments.token_channel`): a stream may move its
    # chunks after the first to that channel. None: every chunk comes on the Ray stream.
    channel: str | None = None
    # The LoRA adapter the body's `model` names (its engine name). The replica serves it from its
    # directory, added since the replica started or not.
    adapter: AdapterRoute | None = None

    # Ray's LLM routers (PrefixCacheAffinityRouter among them) find the prompt of a pending request by
    # looking for an argument with a `messages` or `prompt` attribute, and cannot route one without
    # either (the request waits until the gateway's queue timeout). Exposing exactly the one this request
    # has lets those routers run unchanged: chat's and Anthropic's messages, a completion's prompt, a
    # Responses input. hasattr() is False when these raise.
    @property
    def messages(self) -> Any:
        field = ENDPOINTS[self.endpoint].prompt_field
        if field != "messages" or field not in self.body:
            raise AttributeError("messages")
        return self.body[field]

    @property
    def prompt(self) -> Any:
        described = ENDPOINTS[self.endpoint]
        field = described.prompt_field
        if field == "messages" or not described.generates or field not in self.body:
            raise AttributeError("prompt")
        return self.body[field]


@dataclass(frozen=True)
class Accepted:
    """First item of every reply stream: this replica took the request. `channel`: the address of its
    token channel, where the gateway listens for the chunks of streams that move there. `load`: what its
    engine's scheduler last reported (None: no report yet, or an engine that gives none)."""

    replica_id: str
    channel: str | None = None
    load: EngineLoad | None = None


@dataclass(frozen=True)
class EngineLoad:
    """An engine's scheduler as it last reported: the requests it runs and queues, and the share of its KV
    cache in use. A gateway's flow control reads it (issue 52, item 6): an engine that queues requests while
    it runs fewer than its `max_num_seqs` is bound by its KV cache, and runs at once only what it runs now."""

    running: int
    waiting: int
    kv_cache_usage: float


@dataclass(frozen=True)
class ReplyHead:
    """Second item of every reply stream: the reply's status and, for a whole reply, its JSON body (an
    error's in OpenAI's shape); `stream`: SSE chunks follow. The gateway decides the HTTP status from it
    before any byte goes to the client."""

    status: int
    body: Any = None
    stream: bool = False

    @property
    def error_message(self) -> str:
        error = self.body.get("error") if isinstance(self.body, dict) else None
        return str(error.get("message", "")) if isinstance(error, dict) else ""


@dataclass(frozen=True)
class Moved:
    """On a reply stream, after its first chunk: the stream's other chunks come over the token channel
    (each a `StreamChunk`, then the `StreamEnd`); the Ray call itself ends when the stream does."""


class StreamChunk(NamedTuple):
    """One piece of a streamed reply: the client's bytes exactly as they are to be written (vLLM's own SSE
    event; the gateway never parses it), and beside it what the request had produced in the engine when it
    was made, so a stream cut short is charged its real tokens. A tuple: one per token crosses the token
    channel as a msgpack array and is rebuilt without a constructor's cost."""

    text: str
    prompt_tokens: int
    completion_tokens: int


class StreamEnd(NamedTuple):
    """The last item of a streamed reply: its final usage as the engine counted it, and the error event
    it carried inside its 200, if any (vLLM ends a stream whose engine failed with one)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # where the engine reports it (prompt_tokens_details)
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class Working:
    """Sent by a replica while it computes a whole (not streamed) reply, before the reply head, whenever
    its engine has made progress: it is alive, so the gateway's `replica_timeout_s` of silence never
    mistakes a long reply for a hung replica. It carries what the reply has produced so far (its prompt
    and completion tokens, shunter.engine_usage), so a request whose client leaves before the reply is
    charged that much."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


def find_hint(args: Any, kwargs: Any) -> RouteHint | None:
    """The RouteHint among a pending request's arguments, if the caller sent one."""
    for value in list(args or ()) + list((kwargs or {}).values()):
        if isinstance(value, RouteHint):
            return value
    return None
