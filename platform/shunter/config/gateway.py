"""`gateway:`: the HTTP front door, its replicas, timeouts and per-request limits."""

from __future__ import annotations

from pydantic import Field

from shunter.config.base import StrictModel


class LimitsConfig(StrictModel):
    """What one request may ask for. Every limit answers a clear 400 (413 for the body) before any
    engine works on the request, except the two timeouts, which end a request that runs too long."""

    max_messages: int = Field(default=256, ge=1, description="Most `messages` in one chat request.")
    max_prompt_tokens: int | None = Field(
        default=None, ge=1,
        description="Most prompt tokens one request may send, counted by the model's own tokenizer in the "
        "replica (a batch of completion prompts or embedding inputs: all of them together). null = the "
        "model's context length is the only limit.",
    )
    max_tokens: int = Field(
        default=4096, ge=1,
        description="Most tokens one request may generate: asking more (`max_tokens`, "
        "`max_completion_tokens`) is a 400; a request that does not say gets this many at most (never more "
        "than the model's context).",
    )
    max_n: int = Field(default=8, ge=1, description="Most choices (`n`, `best_of`) one request may ask for.")
    max_embedding_inputs: int = Field(
        default=2048, ge=1,
        description="Most inputs in one embeddings request (OpenAI's bound is 2,048). Each input is an engine "
        "request: it counts toward `max_prompt_tokens` (their sum), the key's token quota and the model's "
        "admission bound as that many requests.",
    )
    max_completion_prompts: int = Field(
        default=2048, ge=1,
        description="Most prompts in one completions batch (`prompt` as a list); counted like embedding inputs.",
    )
    request_timeout_s: float = Field(
        default=600.0, gt=0,
        description="Longest a request may take, queueing included: a reply not finished by then is a 504 "
        "`request_timeout`; a stream still running ends with a `request_timeout` error event.",
    )
    stream_idle_timeout_s: float = Field(
        default=60.0, gt=0,
        description="Longest a stream may send the client nothing once it has started; then it ends with a "
        "`stream_idle_timeout` error event. (A replica silent for its model's `routing.replica_timeout_s` "
        "is also a replica failure; this limit is the client's promise, whichever comes first.)",
    )


class GatewayConfig(StrictModel):
    """The HTTP front door: limits that hold before a request reaches any engine."""

    replicas: int = Field(default=1, ge=1, le=256, description="Gateway replicas (HTTP ingress processes).")
    max_ongoing_requests: int = Field(
        default=1024,
        ge=1,
        description="Requests one gateway replica relays at once. The gateway only waits on engines, so this "
        "is high; Ray Serve's default (5) would cap the whole platform at five concurrent requests.",
    )
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, description="Largest request body accepted; larger gets 413."
    )
    queue_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long a request may wait for a replica of its model to take it (none running, all "
        "full); then 503 with Retry-After. Time spent generating is not limited by this.",
    )
    ready_timeout_s: float = Field(
        default=5.0, gt=0, description="How long GET /ready waits for each model's replica to answer."
    )
    body_timeout_s: float = Field(
        default=10.0, gt=0,
        description="Longest a client may take to send its request body; then 408 `body_timeout`. A body "
        "that trickles in holds a gateway slot, so slow uploads are bounded before any other work.",
    )
    max_body_reads: int = Field(
        default=64, ge=1,
        description="Slow request bodies (still arriving after half a second in which the gateway's loop kept "
        "time) one gateway replica reads at once; past it such a request gets 503 `too_many_uploads` at "
        "once. Bodies that arrive whole take "
        "microseconds; slow uploads cannot hold more than this many of the replica's "
        "`max_ongoing_requests` slots.",
    )
    token_channel: bool = Field(
        default=True,
        description="Streams' chunks after the first travel from the model replica to the gateway over one "
        "ZeroMQ connection per (gateway, replica), a batch per engine step, instead of one Ray message per "
        "chunk (what most of the serving CPU per token was; docs/design.md). Off: every chunk on Ray.",
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="What one request may ask for.")
