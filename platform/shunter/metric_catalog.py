"""Every metric Shunter exports: name, kind, labels, buckets and meaning, in one place.

The recording code (`shunter.routing.metrics`, `shunter.ops.metrics`, `shunter.deployments.gateway.telemetry`) builds its Ray metrics from
these specs, and the dashboard generator (`shunter.ops.dashboards`) writes queries against them. Ray exports
each with a `ray_` prefix (`shunter_requests_total` is scraped as `ray_shunter_requests_total`), adds
its own labels (`WorkerId`, `NodeAddress`, `SessionName`, ...) and, for histograms, the
`_bucket`/`_sum`/`_count` series. A dashboard test scrapes a live app to prove the names below are
what really comes out.

Labels: `model` is always a configured model's name (never a client's string), `version` the model
version (`default` for a model without versions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RAY_PREFIX = "ray_"

# Latency buckets for LLM serving: tens of milliseconds (a cached prefix, a short reply) to minutes
# (a long generation queued behind others on a busy CPU engine).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
RATIO_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
# Tokens one prediction missed by: within a block (128 on CPU, 16 on GPU), a few blocks, a whole prompt.
PREDICTION_ERROR_BUCKETS = (16.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0)
FLOW_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
DRAIN_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
START_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as recorded; scraped as RAY_PREFIX + name
    kind: Kind
    labels: tuple[str, ...]
    description: str
    source: str  # the process that records it: gateway, router, replica, autoscaler, controller, batch, ledger
    buckets: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        return RAY_PREFIX + self.name


_MV = ("model", "version")

CATALOG: tuple[MetricSpec, ...] = (
    # ---- requests, as the gateway relays them (client-perceived) --------------------------------
    MetricSpec("shunter_requests_total", "counter", (*_MV, "endpoint", "status"),
               "Requests answered, by HTTP status; `stream_error` for a stream that ended with an error "
               "event after its 200 head.", "gateway"),
    MetricSpec("shunter_time_to_first_token_seconds", "histogram", (*_MV, "endpoint"),
               "Streamed 2xx requests: from the request's arrival at the gateway to its first token chunk.",
               "gateway", TTFT_BUCKETS),
    MetricSpec("shunter_inter_token_latency_seconds", "histogram", (*_MV, "endpoint"),
               "Streamed 2xx requests: gap between consecutive token chunks, as relayed to the client.",
               "gateway", ITL_BUCKETS),
    MetricSpec("shunter_e2e_request_latency_seconds", "histogram", (*_MV, "endpoint"),
               "2xx requests (streamed or not): from the request's arrival at the gateway to its last byte.",
               "gateway", E2E_BUCKETS),
    MetricSpec("shunter_prompt_tokens_total", "counter", _MV, "Prompt tokens of answered requests.", "gateway"),
    MetricSpec("shunter_completion_tokens_total", "counter", _MV, "Tokens generated for answered requests.",
               "gateway"),
    MetricSpec("shunter_requests_in_flight", "gauge", _MV,
               "Requests a gateway process has sent to the version and not finished relaying.", "gateway"),
    MetricSpec("shunter_requests_queued", "gauge", ("model",),
               "Requests admitted by a gateway process and still waiting for a replica to take them.",
               "gateway"),
    MetricSpec("shunter_flow_queued", "gauge", ("model", "priority_class", "key_name"),
               "Requests admitted by a gateway process and waiting in its flow queue for their turn, by "
               "priority class and tenant (key name; empty without keys).", "gateway"),
    MetricSpec("shunter_flow_wait_seconds", "histogram", ("model", "priority_class", "key_name"),
               "How long a request waited in a gateway's flow queue before its turn, by priority class and "
               "tenant.", "gateway", FLOW_WAIT_BUCKETS),
    MetricSpec("shunter_flow_refusals_total", "counter", ("model", "priority_class", "key_name", "reason"),
               "Requests of a class and tenant that never got a turn: rate_limit_exceeded or "
               "request_exceeds_quota (429, the key's quota), queue_full (429 at admission), "
               "queue_timeout or cold_start_timeout (503 after waiting), client_left (hung up while waiting; "
               "charged nothing), request_timeout (the request timeout passed while it waited).", "gateway"),
    MetricSpec("shunter_replicas_routable", "gauge", _MV,
               "Running replicas a gateway process routes to (Ray's replica set, breakers aside).", "gateway"),
    MetricSpec("shunter_rejections_total", "counter", ("model", "reason"),
               "Requests refused before a replica took them: queue_full (429), cold_start_timeout, "
               "queue_timeout, replicas_unavailable, model_unavailable (503).", "gateway"),
    MetricSpec("shunter_drain_seconds", "histogram", ("model",),
               "Time a leaving replica took to finish the streams relayed from it.", "gateway", DRAIN_BUCKETS),
    MetricSpec("shunter_drain_aborted_total", "counter", ("model",), "Streams ended at the drain timeout.",
               "gateway"),
    # ---- callers: API keys and quotas (key_id: the key's public id, never the key) ---------------------
    MetricSpec("shunter_key_requests_total", "counter", ("key_name", "key_id", "model", "status"),
               "Requests admitted per API key, by the status they ended with (`anonymous` without keys).",
               "gateway"),
    MetricSpec("shunter_key_tokens_total", "counter", ("key_name", "key_id", "model", "kind"),
               "Tokens per API key: kind prompt or completion, from the engine's usage.", "gateway"),
    MetricSpec("shunter_rate_limited_total", "counter", ("key_name", "key_id", "limit"),
               "Requests refused with 429 by a key's quota: limit requests, tokens or too_large.", "gateway"),
    # ---- usage and cost per tenant (the usage ledger's figures; key_name "" = the platform's own) ------
    MetricSpec("shunter_usage_tokens_total", "counter", ("key_name", "model", "adapter", "priority_class", "kind"),
               "Tokens each settled request's key was charged: kind prompt (all of them), cached (of the prompt, "
               "those the engine had cached) or completion; adapter \"\" for the base model.", "gateway"),
    MetricSpec("shunter_usage_cost_total", "counter", ("key_name", "model", "adapter", "priority_class"),
               "Cost of those tokens from the model's `pricing` (its currency; models without pricing add "
               "nothing).", "gateway"),
    MetricSpec("shunter_usage_records_dropped_total", "counter", (),
               "Usage records a gateway dropped, oldest first, past usage.max_buffered_records while the "
               "ledger was unreachable (records and refusal counters; a counter adds the refusals it had not "
               "sent).", "gateway"),
    MetricSpec("shunter_usage_ledger_degraded", "gauge", (),
               "1 while the usage ledger's file takes no writes (full disk, or usage.max_size_mb) and new usage is "
               "held in the ledger's memory, summed per minute; 0 otherwise.", "ledger"),
    MetricSpec("shunter_usage_ledger_held_records_total", "counter", (),
               "Usage records the ledger held in memory because its file took no writes; written to the file once "
               "it takes writes again.", "ledger"),
    # ---- batches (OpenAI's Batch API), from the head node's BatchService ------------------------------
    # `batch` is a batch's id (made by the platform, never a client's string); a batch's gauges are dropped
    # once it ends.
    MetricSpec("shunter_batch_lines_finished_total", "counter", ("batch", "key_id", "outcome"),
               "Batch lines that got their result line: outcome completed (answered 200) or failed (an error "
               "answer, not a request, or not run: cancelled or expired).", "batch"),
    MetricSpec("shunter_batch_lines_pending", "gauge", ("batch", "key_id"),
               "Lines of a batch not yet run (running ones included), while it runs.", "batch"),
    MetricSpec("shunter_batch_lines_running", "gauge", ("batch", "key_id"),
               "Lines of a batch in the gateways now.", "batch"),
    MetricSpec("shunter_auth_failures_total", "counter", ("reason",),
               "Requests refused at the door: missing_key, malformed_header, invalid_key (401); "
               "model_not_allowed, client_key_on_admin, admin_key_on_api (403).", "gateway"),
    # ---- complexity tiers (`model: auto`) -------------------------------------------------------------
    MetricSpec("shunter_tier_requests_total", "counter", ("tier", "class", "reason"),
               "Requests to the tier name by the tier chosen, the request's class and why (complexity, "
               "promoted, hint, allowed).", "gateway"),
    MetricSpec("shunter_tier_tokens_total", "counter", ("tier", "kind"),
               "Tokens of answered tier-routed requests: kind prompt or completion.", "gateway"),
    MetricSpec("shunter_tier_cost_total", "counter", ("tier", "basis"),
               "Estimated cost of answered tier-routed requests at the config's prices: basis routed (the "
               "tier that served them) or top_tier (had every one gone to the top tier).", "gateway"),
    MetricSpec("shunter_tier_agreement", "histogram", ("tier", "class"),
               "The quality monitor's agreement (cosine similarity of answer embeddings) between a lower "
               "tier's answer and the top tier's.", "gateway", RATIO_BUCKETS),
    MetricSpec("shunter_tier_promotions_total", "counter", ("class", "from_tier", "to_tier"),
               "Request classes promoted a tier up by the quality monitor.", "gateway"),
    MetricSpec("shunter_tier_class_floor", "gauge", ("class",),
               "The lowest tier (0-based) a promoted request class may use.", "gateway"),
    # ---- routing, in the gateway's routers ---------------------------------------------------
    MetricSpec("shunter_routing_decisions_total", "counter", (*_MV, "policy", "reason"),
               "Routing decisions by reason: prefix_hit, load_fallback, least_loaded, breaker_skip, retry "
               "(power_of_two and custom policies record their own name).", "router"),
    MetricSpec("shunter_routing_prefix_match_ratio", "histogram", _MV,
               "Share of each routed prompt that the chosen replica held in its KV cache (as the router "
               "believes).", "router", RATIO_BUCKETS),
    MetricSpec("shunter_routing_prefix_predicted_tokens_total", "counter", (*_MV, "source"),
               "Prompt tokens the router predicted the chosen replica held, per routed request whose engine "
               "reported its cached tokens; source: precise (the replica's KV-event report) or approximate.",
               "router"),
    MetricSpec("shunter_routing_prefix_cached_tokens_total", "counter", (*_MV, "source"),
               "Prompt tokens the chosen replica's engine really had cached for the same requests.", "router"),
    MetricSpec("shunter_routing_prefix_prediction_error_tokens", "histogram", (*_MV, "source"),
               "Per routed request: |predicted - cached| prompt tokens.", "router", PREDICTION_ERROR_BUCKETS),
    MetricSpec("shunter_breaker_state", "gauge", (*_MV, "replica"),
               "Circuit breaker per replica: 0 closed, 1 half-open, 2 open.", "router"),
    MetricSpec("shunter_breaker_transitions_total", "counter", (*_MV, "replica", "to"),
               "Circuit breaker state changes per replica.", "router"),
    # ---- engines, from each ModelServer replica -------------------------------------------------
    MetricSpec("shunter_replica_start_seconds", "histogram", (*_MV, "phase"),
               "Seconds each phase of a model replica's start took (shunter.engine.START_PHASES: process, replica_setup, "
               "engine_config, engine_processes, serving_layer, warmup; total: all of them).", "replica",
               START_BUCKETS),
    MetricSpec("shunter_engine_kv_cache_usage_ratio", "gauge", (*_MV, "replica"),
               "Fraction of the engine's KV-cache blocks in use.", "replica"),
    MetricSpec("shunter_engine_prefix_cache_queries_total", "counter", (*_MV, "replica"),
               "Prompt tokens the engine looked up in its prefix cache.", "replica"),
    MetricSpec("shunter_engine_prefix_cache_hits_total", "counter", (*_MV, "replica"),
               "Prompt tokens the engine found in its prefix cache.", "replica"),
    MetricSpec("shunter_engine_requests_running", "gauge", (*_MV, "replica"),
               "Requests the engine is running (decoding or prefilling).", "replica"),
    MetricSpec("shunter_engine_requests_waiting", "gauge", (*_MV, "replica"),
               "Requests waiting in the engine's scheduler queue.", "replica"),
    # LoRA adapters: the `adapter` label takes only names a model serves (its config's adapters and
    # those added through the admin API, at most MAX_ADAPTERS_PER_MODEL of them: deployments/gateway/lora.py);
    # a client's unknown name is a 404 before anything is counted.
    MetricSpec("shunter_adapter_requests_total", "counter", ("model", "adapter", "status"),
               "Requests to each LoRA adapter, by the HTTP status the client got.", "gateway"),
    MetricSpec("shunter_adapter_tokens_total", "counter", ("model", "adapter"),
               "Prompt and completion tokens of the requests to each LoRA adapter.", "gateway"),
    MetricSpec("shunter_adapter_loads_total", "counter", (*_MV, "replica", "adapter"),
               "LoRA adapters loaded by the replica's engine (the first request for an adapter it does not "
               "hold); adapter-aware routing keeps this low.", "replica"),
    MetricSpec("shunter_adapter_load_seconds_total", "counter", (*_MV, "replica"),
               "Seconds the replica's engine spent loading LoRA adapters.", "replica"),
    MetricSpec("shunter_adapters_held", "gauge", (*_MV, "replica"),
               "LoRA adapters the replica's engine holds in host memory.", "replica"),
    MetricSpec("shunter_prefix_view_blocks", "gauge", (*_MV, "replica"),
               "Precise prefix routing: KV blocks the replica's view of its engine's cache holds (from the "
               "engine's KV-cache events).", "replica"),
    MetricSpec("shunter_prefix_view_held_keys", "gauge", (*_MV, "replica"),
               "Precise prefix routing: router prefix keys the replica reports its engine holds.", "replica"),
    MetricSpec("shunter_kv_event_lag_seconds", "gauge", (*_MV, "replica"),
               "Precise prefix routing: from the engine publishing its last KV-event batch to the replica "
               "applying it.", "replica"),
    MetricSpec("shunter_kv_event_losses_total", "counter", (*_MV, "replica"),
               "Precise prefix routing: KV-event gaps the replay socket could not fill (the view was rebuilt).",
               "replica"),
    # ---- autoscaling, from the queue-depth policy in Ray Serve's controller ----------------------------
    MetricSpec("shunter_autoscaling_desired_replicas", "gauge", _MV,
               "Replicas the queue-depth policy asks for (0 for a retired version).", "autoscaler"),
    MetricSpec("shunter_autoscaling_running_replicas", "gauge", _MV, "Replicas running when the policy decided.",
               "autoscaler"),
    MetricSpec("shunter_autoscaling_standby_replicas", "gauge", _MV,
               "Warm standby replicas running (routed nothing until the model needs them; standby_replicas).",
               "autoscaler"),
    MetricSpec("shunter_queue_depth", "gauge", _MV,
               "Requests waiting or running in the engines plus queued ahead of the replicas.", "autoscaler"),
    # ---- rollouts, from the application's control actor -------------------------------------------
    MetricSpec("shunter_rollout_phase", "gauge", ("model", "phase"),
               "1 for the phase the model's latest rollout is in, 0 for the others.", "controller"),
    MetricSpec("shunter_rollout_step", "gauge", ("model",),
               "The step a rollout holds (1-based; 0 when not shifting).", "controller"),
    MetricSpec("shunter_traffic_weight", "gauge", _MV, "Percent of a model's traffic each version gets, as "
               "the gateway applies it (the file's weights, a rollout's or an operator's).", "gateway"),
    MetricSpec("shunter_rollout_gate", "gauge", ("model", "gate"),
               "Gate values of a rollout's latest judgement (error rates, p95s, request counts).", "controller"),
    MetricSpec("shunter_rollout_decisions_total", "counter", ("model", "decision"),
               "Rollout decisions: ready, step, promote, rollback, done, pause, resume.", "controller"),
)

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in CATALOG}


def spec(name: str) -> MetricSpec:
    return BY_NAME[name]


def build(metrics_module: object, names: tuple[str, ...]) -> dict[str, object]:
    """Ray metric objects (`ray.util.metrics`) for the named specs, keyed by name; gauges wrapped so they
    keep reporting (see `shunter.ray_metrics.StickyGauge`)."""
    from shunter.ray_metrics import StickyGauge

    built: dict[str, object] = {}
    for name in names:
        m = BY_NAME[name]
        kind = {"counter": "Counter", "gauge": "Gauge", "histogram": "Histogram"}[m.kind]
        kwargs: dict[str, object] = {"description": m.description, "tag_keys": m.labels}
        if m.kind == "histogram":
            kwargs["boundaries"] = list(m.buckets)
        metric = getattr(metrics_module, kind)(m.name, **kwargs)
        built[name] = StickyGauge(metric) if m.kind == "gauge" else metric
    return built
