"""`routing:` of a model: the routing policy and its circuit breaker."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from shunter.config.base import StrictModel

# Loading a LoRA adapter, in prompt tokens to prefill: a rank-8 SmolLM2 adapter loaded in 226 ms on a
# 2-core machine whose engine prefilled 986 tokens/s, 223 tokens (`shunter bench lora`, 2026-11-26; the
# machines vary by about 30%). A bigger model prefills slower and loads bigger adapters: measure yours.
ADAPTER_LOAD_TOKENS = 256
# Waiting for another adapter's requests to leave the batch (max_loras adapters run at once): about half
# a request's decode. 16-token answers decoded in about 1 s at a 1,000 tokens/s prefill rate on one
# core (`shunter bench lora`); longer answers wait longer: measure yours.
ADAPTER_BUSY_TOKENS = 512


class BreakerConfig(StrictModel):
    """Per-replica circuit breaker, kept by each gateway replica for the replicas it sends to.

    closed --(N consecutive failures, or error rate over the window)--> open --(cooldown)--> half-open
    --(probe succeeds)--> closed; a failed probe opens it again. A failure is an engine error, a replica
    that died or stopped answering (`routing.replica_timeout_s`); a client's 4xx never counts.
    """

    enabled: bool = Field(default=True, description="Turn the breakers off to send to every replica always.")
    consecutive_failures: int = Field(
        default=3, ge=1, description="Failures in a row that open a replica's breaker."
    )
    error_rate: float = Field(
        default=0.5, gt=0, le=1, description="Failure fraction over `window_s` that opens the breaker."
    )
    min_requests: int = Field(
        default=10, ge=1, description="Outcomes needed in the window before `error_rate` is judged."
    )
    window_s: float = Field(default=30.0, gt=0, description="Sliding window of the error rate, seconds.")
    cooldown_s: float = Field(
        default=10.0, gt=0, description="How long an open breaker keeps its replica out before probing it."
    )
    half_open_probes: int = Field(
        default=1, ge=1, description="Requests let through at once to a half-open replica to test it."
    )


class RoutingConfig(StrictModel):
    """How requests are spread over the replicas of this model (one router per gateway process)."""

    policy: Literal["prefix_aware", "least_connections", "power_of_two", "custom"] | None = Field(
        default=None,
        description="prefix_aware: send a request where its prompt prefix is likely cached in KV, unless "
        "that replica is loaded well beyond the others; least_connections: the replica with the fewest "
        "requests in flight; power_of_two: Ray Serve's default (two random replicas, shorter queue); "
        "custom: `router_class`. null = prefix_aware for generate models, least_connections for embed.",
    )
    prefix_source: Literal["precise", "approximate"] | None = Field(
        default=None,
        description="prefix_aware: where the router learns what each replica caches. precise: from the "
        "engine's own KV-cache events (each replica subscribes to its engine and reports which prefixes it "
        "really holds; evictions and restarts show at the next report); approximate: from what the router "
        "sent there (no events needed). null = precise where the engine publishes events (vLLM engines), "
        "approximate otherwise; a replica whose event view is not exact is judged approximately until it is.",
    )
    router_class: str | None = Field(
        default=None,
        description="policy custom only: import path `module:Class` (or `module.Class`) of any Ray Serve "
        "RequestRouter, e.g. ray.serve.llm.request_router:PrefixCacheAffinityRouter. The circuit "
        "breakers and retry avoidance still apply around it.",
    )
    router_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="policy custom only: keyword arguments of its initialize_state."
    )
    load_cost_tokens: int = Field(
        default=32,
        ge=0,
        description="prefix_aware trade-off: the decode work of one request in flight, in prompt tokens to "
        "prefill. A replica is chosen by least (prefill queued there + prompt tokens it lacks x (1 + requests "
        "in flight there) + load_cost_tokens x requests in flight), so a cached prefix keeps its replica "
        "until the queue there costs more than a cold prefill elsewhere, up to `max_load_gap`.",
    )
    adapter_load_tokens: int = Field(
        default=ADAPTER_LOAD_TOKENS,
        ge=0,
        description="prefix_aware, models with LoRA adapters: what loading an adapter costs a replica, in "
        "prompt tokens to prefill (its engine stalls while it loads). A replica that does not hold the "
        "adapter a request names costs this much more, times (1 + requests in flight there). The default "
        "is measured: `shunter bench lora` prints the load time and prefill rate it comes from.",
    )
    adapter_busy_tokens: int = Field(
        default=ADAPTER_BUSY_TOKENS,
        ge=0,
        description="prefix_aware, models with LoRA adapters: what waiting for a free adapter slot costs, in "
        "prompt tokens to prefill. A replica whose engine runs as many other adapters as it mixes in one batch "
        "(`engine.max_loras`) holds a request for one more back until one of them has no request left, about "
        "half a request's decode; it costs this much more. `shunter bench lora` prints the figure it measures.",
    )
    max_load_gap: int = Field(
        default=8,
        ge=0,
        description="prefix_aware guard: never prefer a replica carrying more than this many requests "
        "beyond the least loaded one, however much of the prompt it holds (a hot prefix spreads out).",
    )
    replica_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="A replica that sends nothing for this long after taking a request (no reply head, no "
        "stream chunk) is treated as hung: the request fails over and the breaker counts a failure. "
        "Non-streamed replies arrive whole, so keep this above the longest non-streamed generation.",
    )
    retry_once: bool = Field(
        default=True,
        description="Retry a request once on another replica when its replica fails before the first "
        "byte reached the client (never after: a started stream ends with an error event).",
    )
    stats_period_s: float = Field(
        default=2.0, gt=0, description="How often Ray polls each replica for its routing stats (KV capacity)."
    )
    breaker: BreakerConfig = Field(default_factory=BreakerConfig, description="Per-replica circuit breaker.")

    @model_validator(mode="after")
    def _custom_needs_class(self) -> RoutingConfig:
        if self.policy == "custom" and not self.router_class:
            raise ValueError("policy custom needs router_class: the import path of a Ray RequestRouter")
        if self.policy != "custom" and (self.router_class or self.router_kwargs):
            raise ValueError("router_class and router_kwargs apply to policy custom only")
        if self.router_class and not re.match(r"^[A-Za-z_][\w.]*[:.][A-Za-z_]\w*$", self.router_class):
            raise ValueError(f"router_class {self.router_class!r} must look like 'package.module:Class'")
        return self
