"""Shunter's Grafana dashboards: overview, per model, routing, capacity, flow control, rollouts.

Each function returns one dashboard's JSON. Panel texts say what a series means in Shunter's terms
(see README: Routing; Scaling, overload and draining; Versions and rollouts), so a reader on call
does not need the source to read a panel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shunter import metric_catalog
from shunter.ops.dashboards.builder import (
    Json,
    Query,
    Row,
    State,
    custom_variable,
    dashboard,
    datasource_variable,
    heatmap,
    query_variable,
    stat,
    state_timeline,
    timeseries,
)
from shunter.ops.dashboards.queries import (
    MODEL,
    MODEL_VERSION,
    error_ratio,
    gauge_max,
    gauge_sum,
    goodput,
    increase,
    mean,
    quantile,
    rate,
    selector,
    series,
    share,
)
from shunter.ops.metrics import ROLLOUT_PHASES

QUANTILES = (0.5, 0.95, 0.99)

# SLO choices, in seconds. Each must be a bucket boundary of its histogram: `le="$slo_ttft"` selects
# exactly one bucket series, so a value between boundaries would select nothing.
SLO_TTFT_CHOICES = (0.5, 1.0, 2.5, 5.0)
SLO_TTFT_DEFAULT = 1.0
SLO_E2E_CHOICES = (10.0, 20.0, 40.0, 60.0)
SLO_E2E_DEFAULT = 20.0

# Placement reasons of the prefix-aware policy (shunter.routing.policy), named here because ops/ does not
# import routing/; the unit tests hold them to routing's constants.
PLACEMENT_REASONS = ("prefix_hit", "load_fallback", "least_loaded")
BREAKER_SKIP, RETRY = "breaker_skip", "retry"

BREAKER_STATES = (State(0, "closed", "green"), State(1, "half-open", "yellow"), State(2, "open", "red"))
PHASE_COLORS = {"deploying": "blue", "shifting": "yellow", "promoted": "green", "rolling_back": "red",
                "done": "text"}

SEC = "s"
PERCENT_UNIT = "percentunit"  # a 0..1 ratio shown as percent
PER_SECOND = "reqps"


def label_legend(*labels: str) -> str:
    """Grafana's legend template naming a series by its labels: `{{model}} {{version}}`."""
    return " ".join("{{" + label + "}}" for label in labels)


def percentile(q: float) -> str:
    return f"p{round(q * 100)}"


# ---- variables ------------------------------------------------------------------------------------

def model_variable() -> Json:
    return query_variable(
        "model", "Model", f"label_values({series('shunter_requests_total')}, model)",
        description="Configured models that have answered requests in the time range.")


def version_variable(source: str = "shunter_requests_total") -> Json:
    return query_variable(
        "version", "Version", f"label_values({selector(source, MODEL)}, version)",
        description="Versions of the chosen models (`default` for a model without versions).")


def le_label(bound: float) -> str:
    """A bucket boundary as the exporter writes the `le` label (Ray's Prometheus exporter and
    Prometheus 3's normalisation alike write floats: `1.0`, not `1`)."""
    return repr(float(bound))


def slo_variable(name: str, label: str, histogram: str, choices: Sequence[float], default: float) -> Json:
    buckets = metric_catalog.spec(histogram).buckets
    off_bucket = [c for c in choices if c not in buckets]
    if off_bucket:
        raise ValueError(f"{name}: {off_bucket} are not bucket boundaries of {histogram} {buckets}")
    return custom_variable(
        name, label, [le_label(c) for c in choices], le_label(default),
        description=f"SLO threshold in seconds; the choices are bucket boundaries of {histogram}, "
        "so the share under it is exact, not interpolated.")


def standard_variables(version_source: str = "shunter_requests_total") -> list[Json]:
    return [datasource_variable(), model_variable(), version_variable(version_source)]


# ---- shared panels ---------------------------------------------------------------------------------

def latency_panel(title: str, histogram: str, what: str, matchers: str, by: Sequence[str] = (),
                  width: int = 8) -> Json:
    """p50, p95 and p99 of a latency histogram, one line per quantile (and per `by` group)."""
    queries = [Query(quantile(q, histogram, matchers, by), f"{label_legend(*by)} {percentile(q)}".strip())
               for q in QUANTILES]
    return timeseries(
        title, f"{what}: p50, p95 and p99 of successful (2xx) requests, interpolated within the histogram's "
        "buckets (a quantile past the last finite bucket reads as that bucket's bound).", queries, unit=SEC,
        width=width)


def error_ratio_panel(title: str, matchers: str, by: Sequence[str], legend: str, width: int = 12) -> Json:
    return timeseries(
        title, "Failed requests over all answered requests: any 5xx (engine errors and 503 refusals such as "
        "cold_start_timeout) plus streams that broke after their 200 head (`stream_error`). Client "
        "errors (4xx) and 429 queue_full are not failures.",
        [Query(error_ratio(matchers, by), legend)], unit=PERCENT_UNIT, width=width)


def tokens_panel(title: str, counter: str, what: str, by: Sequence[str], legend: str, width: int = 12,
                 matchers: str = MODEL) -> Json:
    return timeseries(title, f"{what} per second, counted by the gateway when a request is answered.",
                      [Query(rate(counter, matchers, by), legend)], unit="short", width=width, stacked=True)


def weight_panel(title: str, matchers: str, width: int) -> Json:
    return timeseries(
        title, "Percent of each model's traffic sent to each version, as the rollout controller set it "
        "(a rollout's steps, a promotion, a rollback or `shunter weights set`).",
        [Query(gauge_max("shunter_traffic_weight", matchers, ("model", "version")), "{{model}} {{version}}")],
        unit="percent", width=width, max_value=100, legend_calcs=("lastNotNull",))


# ---- shunter-overview ------------------------------------------------------------------------------

def overview() -> Json:
    ttft, e2e = "shunter_time_to_first_token_seconds", "shunter_e2e_request_latency_seconds"
    summary = Row("Summary", (
        stat("Requests/s", "Requests answered per second across the chosen models, any status.",
             Query(rate("shunter_requests_total", MODEL), "requests/s"), unit=PER_SECOND),
        stat("Error ratio", "Failed requests (5xx and broken streams) over all answered requests.",
             Query(error_ratio(MODEL), "error ratio"), unit=PERCENT_UNIT, decimals=2,
             thresholds=((None, "green"), (0.01, "orange"), (0.05, "red"))),
        stat("TTFT p95", "95th percentile time to first token: arrival at the gateway to the first token "
             "(streams) or the whole reply (non-streamed).", Query(quantile(0.95, ttft, MODEL), "p95"),
             unit=SEC),
        stat("End-to-end p95", "95th percentile time from arrival at the gateway to the reply's last byte.",
             Query(quantile(0.95, e2e, MODEL), "p95"), unit=SEC),
        stat("TTFT within SLO", "Goodput: share of requests answered successfully with a time to first "
             "token of at most $slo_ttft s, out of all requests except client errors (429 refusals and "
             "failures count against it).",
             Query(goodput(ttft, MODEL, "$slo_ttft"), "goodput"), unit=PERCENT_UNIT, decimals=1,
             thresholds=((None, "red"), (0.9, "orange"), (0.99, "green"))),
        stat("Rejections/s", "Requests refused before any replica took them (429 queue_full, 503 "
             "cold_start_timeout, queue_timeout, replicas_unavailable, model_unavailable).",
             Query(f'{rate("shunter_rejections_total", MODEL)} or vector(0)', "rejections/s"), unit=PER_SECOND,
             thresholds=((None, "green"), (0.01, "orange"))),
    ))
    traffic = Row("Traffic", (
        timeseries("Requests/s by model", "Requests answered per second, any status.",
                   [Query(rate("shunter_requests_total", MODEL, ("model",)), "{{model}}")],
                   unit=PER_SECOND, stacked=True),
        timeseries("Requests/s by status", "Requests answered per second by HTTP status; `stream_error` is a "
                   "stream that ended with an error event after its 200 head, 499 a client that went away.",
                   [Query(rate("shunter_requests_total", MODEL, ("status",)), "{{status}}")],
                   unit=PER_SECOND, stacked=True),
        error_ratio_panel("Error ratio by model", MODEL, ("model",), "{{model}}"),
        timeseries("Rejections/s by reason", "Requests refused before a replica took them: queue_full (429, "
                   "admission control), cold_start_timeout, queue_timeout, replicas_unavailable (every "
                   "breaker open), model_unavailable (503s). Admitted requests are never refused.",
                   [Query(rate("shunter_rejections_total", MODEL, ("reason",)), "{{reason}}")],
                   unit=PER_SECOND, stacked=True),
    ))
    latency = Row("Latency", (
        latency_panel("Time to first token", ttft, "Time from arrival at the gateway to the first token "
                      "(streams) or the whole reply (non-streamed)", MODEL),
        latency_panel("Inter-token latency", "shunter_inter_token_latency_seconds",
                      "Gap between consecutive token chunks of a stream, as relayed to the client", MODEL),
        latency_panel("End-to-end latency", e2e, "Time from arrival at the gateway to the last byte", MODEL),
        latency_panel("TTFT p50/p95/p99 by model", ttft, "Time to first token per model", MODEL,
                      by=("model",), width=12),
        heatmap("TTFT distribution", "Requests per time-to-first-token bucket over time: a second band "
                "of slow requests (a cold prefill, a queue) shows here before it moves p95.",
                Query(f"sum by (le) (increase({selector(ttft, MODEL, '_bucket')}[$__rate_interval]))",
                      "{{le}}"), unit=SEC),
    ))
    throughput = Row("Throughput", (
        tokens_panel("Output tokens/s by model", "shunter_completion_tokens_total", "Generated tokens",
                     ("model",), "{{model}}"),
        tokens_panel("Prompt tokens/s by model", "shunter_prompt_tokens_total", "Prompt tokens",
                     ("model",), "{{model}}"),
    ))
    slo_row = Row("Goodput (SLO attainment)", (
        timeseries("Requests with TTFT ≤ $slo_ttft s", "Goodput: share of requests answered successfully "
                   "with a time to first token within the TTFT SLO (the `slo_ttft` variable, a bucket "
                   "boundary, so the share is exact), out of all requests except client errors: failures, "
                   "broken streams and 429 refusals count against it.",
                   [Query(goodput(ttft, MODEL, "$slo_ttft", ("model",)), "{{model}}")],
                   unit=PERCENT_UNIT, max_value=1),
        timeseries("Requests with end-to-end ≤ $slo_e2e s", "Goodput: share of requests answered "
                   "successfully to the last byte within the end-to-end SLO (the `slo_e2e` variable, a bucket "
                   "boundary), out of all requests except client errors.",
                   [Query(goodput(e2e, MODEL, "$slo_e2e", ("model",)), "{{model}}")],
                   unit=PERCENT_UNIT, max_value=1),
    ))
    variables = [
        datasource_variable(), model_variable(),
        slo_variable("slo_ttft", "TTFT SLO (s)", ttft, SLO_TTFT_CHOICES, SLO_TTFT_DEFAULT),
        slo_variable("slo_e2e", "End-to-end SLO (s)", e2e, SLO_E2E_CHOICES, SLO_E2E_DEFAULT),
    ]
    return dashboard(
        uid="shunter-overview", title="Shunter / Overview",
        description="Client-perceived traffic, errors, latency, throughput and SLO attainment of every "
        "model, as Shunter's gateway measures them.",
        variables=variables, rows=(summary, traffic, latency, throughput, slo_row))


# ---- shunter-model ---------------------------------------------------------------------------------

def model() -> Json:
    by_version = ("version",)
    per_model = Row("Model $model", repeat="model", panels=(
        timeseries("Requests/s by version and status", "Requests answered per second for this model, by "
                   "version and HTTP status (`stream_error`: a stream broken after its 200 head).",
                   [Query(rate("shunter_requests_total", MODEL_VERSION, ("version", "status")),
                          "{{version}} {{status}}")], unit=PER_SECOND, stacked=True),
        error_ratio_panel("Error ratio by version", MODEL_VERSION, by_version, "{{version}}"),
        latency_panel("Time to first token by version", "shunter_time_to_first_token_seconds",
                      "Time to first token per version", MODEL_VERSION, by_version),
        latency_panel("Inter-token latency by version", "shunter_inter_token_latency_seconds",
                      "Gap between token chunks of a stream per version", MODEL_VERSION, by_version),
        latency_panel("End-to-end latency by version", "shunter_e2e_request_latency_seconds",
                      "Arrival to last byte per version", MODEL_VERSION, by_version),
        tokens_panel("Output tokens/s by version", "shunter_completion_tokens_total", "Generated tokens",
                     by_version, "{{version}}", width=8, matchers=MODEL_VERSION),
        tokens_panel("Prompt tokens/s by version", "shunter_prompt_tokens_total", "Prompt tokens",
                     by_version, "{{version}}", width=8, matchers=MODEL_VERSION),
        weight_panel("Traffic weight by version", MODEL_VERSION, width=8),
    ))
    return dashboard(
        uid="shunter-model", title="Shunter / Model",
        description="One row per chosen model: its traffic, errors, latency and tokens split by version, "
        "with the traffic weights that split them.",
        variables=standard_variables(), rows=(per_model,))


# ---- shunter-routing -------------------------------------------------------------------------------

def routing() -> Json:
    decisions = "shunter_routing_decisions_total"
    placements = f'{MODEL_VERSION}, reason=~"{"|".join(PLACEMENT_REASONS)}"'
    decision_row = Row("Decisions", (
        timeseries("Routing decisions/s by reason", "Placements by reason: prefix_hit (the replica holding "
                   "the longest cached prefix took it), load_fallback (one held more, load sent it elsewhere), "
                   "least_loaded (no replica held any of it); power_of_two and custom policies record their "
                   "own name. Plus breaker_skip (an open replica left out) and retry (sent again after a "
                   "replica failed).",
                   [Query(rate(decisions, MODEL_VERSION, ("model", "reason")), "{{model}} {{reason}}")],
                   unit="ops", stacked=True),
        timeseries("Prefix-hit share of placements", "Share of prefix-aware placements that went to the "
                   "replica holding the longest cached prefix. Low with much shared prefix traffic means load "
                   "is overriding affinity (see load_cost_tokens, max_load_gap). No data for other policies.",
                   [Query(share(rate(decisions, f'{MODEL_VERSION}, reason="{PLACEMENT_REASONS[0]}"', ("model",)),
                                rate(decisions, placements, ("model",))), "{{model}}")],
                   unit=PERCENT_UNIT, max_value=1),
        timeseries("Breaker skips and retries/s", "breaker_skip: an open breaker kept a replica out of a "
                   "choice; retry: the gateway sent a request again after a replica failed before its first "
                   "byte. Either one rising means a replica is failing.",
                   [Query(rate(decisions, f'{MODEL_VERSION}, reason=~"{BREAKER_SKIP}|{RETRY}"',
                               ("model", "reason")), "{{model}} {{reason}}")], unit="ops", width=24),
    ))
    match, hits, lookups = ("shunter_routing_prefix_match_ratio", "shunter_engine_prefix_cache_hits_total",
                            "shunter_engine_prefix_cache_queries_total")
    per_replica = ("model", "version", "replica")
    predicted, cached, error = ("shunter_routing_prefix_predicted_tokens_total",
                                "shunter_routing_prefix_cached_tokens_total",
                                "shunter_routing_prefix_prediction_error_tokens")
    cache_row = Row("Prefix cache", (
        timeseries("Prefix match ratio (router's estimate)", "Share of each routed prompt that the chosen "
                   "replica held in its KV cache, as the router believes (chunks of rendered text, not "
                   "tokens); p50 and p90 per model.",
                   [Query(quantile(q, match, MODEL_VERSION, ("model",)), "{{model}} " + percentile(q))
                    for q in (0.5, 0.9)], unit=PERCENT_UNIT, max_value=1),
        timeseries("Router estimate vs engine hit rate", "Mean prefix match the router predicted (per "
                   "request) beside the engines' own prefix-cache hit rate (per prompt token). A wide gap "
                   "means the router's index has drifted from what the engines really hold.",
                   [Query(mean(match, MODEL_VERSION, ("model",)), "{{model}} router estimate"),
                    Query(share(rate(hits, MODEL_VERSION, ("model",)), rate(lookups, MODEL_VERSION, ("model",))),
                          "{{model}} engine hit rate")], unit=PERCENT_UNIT, max_value=1),
        timeseries("Predicted vs cached prompt tokens/s", "Per routed request, the prompt tokens the router "
                   "predicted the chosen replica held (precise: from the replicas' KV-event reports; "
                   "approximate: from what it sent) beside the tokens that engine really found cached (its "
                   "usage's cached_tokens). Predicted above cached: the router's picture of the caches is stale.",
                   [Query(rate(predicted, MODEL_VERSION, ("model", "source")), "{{model}} predicted ({{source}})"),
                    Query(rate(cached, MODEL_VERSION, ("model", "source")), "{{model}} cached ({{source}})")],
                   unit="short"),
        timeseries("Prediction error per request (p90)", "How far each request's predicted cached tokens were "
                   "from the engine's: within a KV block (128 tokens on CPU, 16 on GPU) is as good as the "
                   "router's character chunks can be.",
                   [Query(quantile(0.9, error, MODEL_VERSION, ("model", "source")), "{{model}} p90 ({{source}})")],
                   unit="short"),
        timeseries("Engine prefix-cache hit rate per replica", "Prompt tokens each engine found in its prefix "
                   "cache over those it looked up. One replica far below the others is getting the cold "
                   "traffic.",
                   [Query(share(rate(hits, MODEL_VERSION, per_replica), rate(lookups, MODEL_VERSION, per_replica)),
                          "{{model}} {{version}} {{replica}}")], unit=PERCENT_UNIT, max_value=1, width=24),
    ))
    breaker_state = gauge_max("shunter_breaker_state", MODEL_VERSION, per_replica)
    breaker_row = Row("Circuit breakers", (
        state_timeline("Breaker state per replica", "Circuit breaker of each replica, worst view across "
                       "gateway replicas: closed, half-open (probes let through) or open (no traffic for "
                       "cooldown_s).", [Query(breaker_state, "{{model}} {{version}} {{replica}}")],
                       BREAKER_STATES, height=8),
        stat("Open breakers", "Replicas whose breaker is open in at least one gateway replica. Every breaker "
             "of a model open means 503 replicas_unavailable.",
             Query(f"sum({breaker_state} == bool 2) or vector(0)", "open"), unit="short", width=6, height=8,
             thresholds=((None, "green"), (1, "red"))),
        timeseries("Breaker transitions", "Breaker state changes over the trailing rate window ($__rate_interval), by replica and new state "
                   "(open, half_open, closed).",
                   [Query(increase("shunter_breaker_transitions_total", MODEL_VERSION, ("model", "replica", "to")),
                          "{{model}} {{replica}} → {{to}}")], unit="short", bars=True, width=18, height=8),
    ))
    return dashboard(
        uid="shunter-routing", title="Shunter / Routing",
        description="How the gateway's routers place requests: decisions by reason, predicted and real "
        "prefix-cache reuse, LoRA adapters and where they load, and the circuit breakers per replica.",
        variables=standard_variables(), rows=(decision_row, cache_row, _adapter_row(per_replica), breaker_row))


def _adapter_row(per_replica: tuple[str, ...]) -> Row:
    """LoRA adapters: the busiest ones (top 10: a model may serve a thousand), and the loads each replica
    paid for them, which adapter-aware routing keeps down."""
    requests, tokens = "shunter_adapter_requests_total", "shunter_adapter_tokens_total"
    loads, load_seconds = "shunter_adapter_loads_total", "shunter_adapter_load_seconds_total"
    return Row("LoRA adapters", (
        timeseries("Requests/s by adapter (top 10)", "Requests to each LoRA adapter, the ten busiest. An "
                   "adapter's requests count under its base model in every other panel.",
                   [Query(f"topk(10, {rate(requests, MODEL, ('model', 'adapter'))})", "{{model}}:{{adapter}}")],
                   unit="ops"),
        timeseries("Tokens/s by adapter (top 10)", "Prompt and completion tokens of each adapter's requests, "
                   "the ten busiest: the usage to bill or to give an adapter its own replicas.",
                   [Query(f"topk(10, {rate(tokens, MODEL, ('model', 'adapter'))})", "{{model}}:{{adapter}}")],
                   unit="short"),
        timeseries("Adapter loads/s per replica", "Adapters each replica's engine loaded (its first request "
                   "for an adapter it did not hold). Steady loads mean more adapters in use than the replicas "
                   "hold (engine.max_cpu_loras) or routing that ignores where they are.",
                   [Query(rate(loads, MODEL_VERSION, per_replica), "{{model}} {{version}} {{replica}}")],
                   unit="ops"),
        timeseries("Time spent loading adapters", "Share of each replica's time its engine spent loading "
                   "adapters (its steps stall meanwhile), beside the adapters it holds.",
                   [Query(rate(load_seconds, MODEL_VERSION, per_replica), "{{model}} {{version}} {{replica}} loading"),
                    Query(gauge_max("shunter_adapters_held", MODEL_VERSION, per_replica),
                          "{{model}} {{version}} {{replica}} held")], unit="short"),
    ))


# ---- shunter-capacity ------------------------------------------------------------------------------

def capacity() -> Json:
    per_replica, per_version = ("model", "version", "replica"), ("model", "version")
    load_row = Row("Load", (
        timeseries("Requests in flight", "Requests the gateways have sent to each version and not finished "
                   "relaying, summed over gateway replicas.",
                   [Query(gauge_sum("shunter_requests_in_flight", MODEL_VERSION, per_version),
                          "{{model}} {{version}}")], width=8, stacked=True),
        timeseries("Requests queued at the gateway", "Requests admitted and still waiting for a replica to "
                   "take them (a cold start, every replica full), summed over gateway replicas.",
                   [Query(gauge_sum("shunter_requests_queued", MODEL, ("model",)), "{{model}}")],
                   width=8, stacked=True),
        timeseries("Rejections/s by model and reason", "Requests refused before a replica took them: "
                   "queue_full is admission control's 429 (running replicas × max_ongoing_requests + "
                   "max_queued_requests are taken); the others are 503s.",
                   [Query(rate("shunter_rejections_total", MODEL, ("model", "reason")), "{{model}} {{reason}}")],
                   unit=PER_SECOND, width=8, stacked=True),
    ))
    engine_row = Row("Engines", (
        timeseries("Engine requests running per replica", "Requests each engine is running (prefilling or "
                   "decoding), as the replica reports its vLLM scheduler.",
                   [Query(gauge_max("shunter_engine_requests_running", MODEL_VERSION, per_replica),
                          "{{model}} {{version}} {{replica}}")], width=8),
        timeseries("Engine requests waiting per replica", "Requests waiting in each engine's scheduler "
                   "queue: work past max_num_seqs or out of KV-cache room.",
                   [Query(gauge_max("shunter_engine_requests_waiting", MODEL_VERSION, per_replica),
                          "{{model}} {{version}} {{replica}}")], width=8),
        timeseries("KV-cache usage per replica", "Fraction of each engine's KV-cache blocks in use; near 100% "
                   "the engine preempts or queues requests and evicts cached prefixes.",
                   [Query(gauge_max("shunter_engine_kv_cache_usage_ratio", MODEL_VERSION, per_replica),
                          "{{model}} {{version}} {{replica}}")], unit=PERCENT_UNIT, max_value=1, width=8),
    ))
    replica_row = Row("Replicas and autoscaling", (
        timeseries("Replicas: routable, desired, running", "Routable: running replicas the gateway routes to "
                   "(breakers aside). Desired: what Shunter's queue-depth policy asks for (0 for a retired "
                   "version). Running: replicas running when the policy decided. Desired above running for "
                   "long means replicas cannot start or be placed.",
                   [Query(gauge_max("shunter_replicas_routable", MODEL_VERSION, per_version),
                          "{{model}} {{version}} routable"),
                    Query(gauge_max("shunter_autoscaling_desired_replicas", MODEL_VERSION, per_version),
                          "{{model}} {{version}} desired"),
                    Query(gauge_max("shunter_autoscaling_running_replicas", MODEL_VERSION, per_version),
                          "{{model}} {{version}} running")], legend_calcs=("lastNotNull", "max")),
        timeseries("Queue depth (autoscaling signal)", "Requests waiting or running in the engines plus those "
                   "queued ahead of the replicas: what the policy divides by target_queue_per_replica.",
                   [Query(gauge_max("shunter_queue_depth", MODEL_VERSION, per_version), "{{model}} {{version}}")]),
        timeseries("Queue depth per running replica", "Queue depth over running replicas: compare with the "
                   "model's target_queue_per_replica (scale-up above it, scale-down below 80% of it).",
                   [Query(f"{gauge_max('shunter_queue_depth', MODEL_VERSION, per_version)} / clamp_min("
                          f"{gauge_max('shunter_autoscaling_running_replicas', MODEL_VERSION, per_version)}, 1)",
                          "{{model}} {{version}}")]),
        timeseries("Ray Serve healthy replicas per deployment", "Ray Serve's own count of healthy replicas of "
                   "each deployment of the app (model-<name>, model-<name>--<version>, gateway); not filtered "
                   "by the model variable, since deployments are named after sanitised model names.",
                   [Query('sum by (application, deployment) (ray_serve_deployment_replica_healthy{'
                          'deployment=~"gateway|model-.+"})', "{{application}} {{deployment}}")],
                   legend_calcs=("lastNotNull", "min")),
    ))
    drain = "shunter_drain_seconds"
    drain_row = Row("Draining", (
        timeseries("Drain duration", "Time a leaving replica (scale-down, update, shutdown) took to finish the "
                   "streams relayed from it; p50 and p95 per model. Near draining.timeout_s means streams are "
                   "being cut.",
                   [Query(quantile(q, drain, MODEL, ("model",)), "{{model}} " + percentile(q))
                    for q in (0.5, 0.95)], unit=SEC),
        timeseries("Streams aborted at the drain timeout", "Streams still running draining.timeout_s after "
                   "their replica left, ended with a replica_drain_timeout error event.",
                   [Query(increase("shunter_drain_aborted_total", MODEL, ("model",)), "{{model}}")],
                   bars=True),
    ))
    return dashboard(
        uid="shunter-capacity", title="Shunter / Capacity",
        description="Load against capacity: requests in flight and queued, engine queues and KV cache per "
        "replica, replica counts and the autoscaler's signal, draining.",
        variables=standard_variables(), rows=(load_row, engine_row, replica_row, drain_row))


# ---- shunter-flow ----------------------------------------------------------------------------------

def flow() -> Json:
    """Who goes first when the fleet is full (README: Priority classes and fair shares; Usage and cost per
    tenant): the flow queues by class and tenant, what they refused, and what each tenant was served."""
    by_class, by_tenant = ("model", "priority_class"), ("model", "key_name")
    wait = "shunter_flow_wait_seconds"
    queue_row = Row("Flow queues", (
        timeseries("Waiting by priority class", "Admitted requests waiting in the gateways' flow queues for "
                   "their turn, per class, summed over gateway replicas. Strict priority: a class waits only "
                   "while the more urgent ones fill the model (or it reached its capacity_share).",
                   [Query(gauge_sum("shunter_flow_queued", MODEL, by_class), "{{model}} {{priority_class}}")],
                   width=8, stacked=True),
        timeseries("Waiting by tenant", "The same requests per tenant (API key name; empty without keys). "
                   "Inside a class, keys take turns by weighted fair share, so one tenant's flood waits "
                   "behind its own requests, not in front of others'.",
                   [Query(gauge_sum("shunter_flow_queued", MODEL, by_tenant), "{{model}} {{key_name}}")],
                   width=8, stacked=True),
        timeseries("Wait for a turn by class", "How long requests waited in the flow queue before a replica "
                   "slot was theirs, p50 and p99 per class: compare with each class's max_wait_s.",
                   [Query(quantile(q, wait, MODEL, by_class), "{{model}} {{priority_class}} " + percentile(q))
                    for q in (0.5, 0.99)], unit=SEC, width=8),
    ))
    refusal_row = Row("Refusals", (
        timeseries("Never got a turn, by class and reason", "rate_limit_exceeded and request_exceeds_quota: "
                   "429 from the key's own quota; queue_full: 429 at admission (the class and the more urgent "
                   "ones fill the bound, or the expected wait exceeds the deadline); queue_timeout and "
                   "cold_start_timeout: 503 after waiting; client_left: hung up while waiting (charged "
                   "nothing); request_timeout: the request timeout passed while waiting.",
                   [Query(rate("shunter_flow_refusals_total", MODEL, ("priority_class", "reason")),
                          "{{priority_class}} {{reason}}")], unit=PER_SECOND, width=12, stacked=True),
        timeseries("Never got a turn, by tenant", "The same refusals per tenant: a tenant sending more than "
                   "its quota or its share is the one that waits and is refused.",
                   [Query(rate("shunter_flow_refusals_total", MODEL, ("key_name", "reason")),
                          "{{key_name}} {{reason}}")], unit=PER_SECOND, width=12, stacked=True),
    ))
    usage = "shunter_usage_tokens_total"
    served = f'kind="completion", {MODEL}'
    share_row = Row("What each tenant was served", (
        timeseries("Share of output tokens by tenant", "Each key's share of the tokens the model generated: "
                   "inside a class, compare with the keys' weights (auth.keys[].weight).",
                   [Query(f"{rate(usage, served, ('key_name',))} / ignoring(key_name) group_left "
                          f"{rate(usage, served)}", "{{key_name}}")],
                   unit=PERCENT_UNIT, max_value=1, width=8, stacked=True),
        timeseries("Output tokens/s by class", "Tokens generated per second for each priority class: batch "
                   "work fills what the more urgent classes leave.",
                   [Query(rate(usage, served, ("priority_class",)), "{{priority_class}}")],
                   unit=PER_SECOND, width=8, stacked=True),
        timeseries("Cost/s by tenant", "Spend per second per key at the models' configured pricing "
                   "(models[].pricing; nothing without it).",
                   [Query(rate("shunter_usage_cost_total", MODEL, ("key_name",)), "{{key_name}}")],
                   width=8, stacked=True),
    ))
    finished, pending = "shunter_batch_lines_finished_total", "shunter_batch_lines_pending"
    batch_row = Row("Batches (OpenAI's Batch API)", (
        timeseries("Batch lines/s", "Lines each batch finished per second (completed: answered 200; failed: an "
                   "error answer, a line that was not a request, or one cancelled or expired). Batches run in "
                   "the least urgent class: they speed up when interactive traffic leaves room.",
                   [Query(rate(finished, "", ("batch", "outcome")), "{{batch}} {{outcome}}")],
                   unit=PER_SECOND, width=8, stacked=True),
        timeseries("Batch lines to run", "Lines of each running batch still to run (those in the gateways "
                   "now included); a batch's series ends when it does.",
                   [Query(gauge_max(pending, "", ("batch",)), "{{batch}}")], width=8),
        timeseries("Batch ETA", "Each running batch's lines to run over its lines finished per second in the "
                   "trailing rate window: when it ends at today's pace.",
                   [Query(f"{gauge_max(pending, '', ('batch',))} / {rate(finished, '', ('batch',))}", "{{batch}}")],
                   unit=SEC, width=8),
    ))
    return dashboard(
        uid="shunter-flow", title="Shunter / Flow control",
        description="Priority classes and tenants when the fleet is full: who waits, for how long, who is "
        "refused and why, the share of the model each tenant is served, and the batches running on what is "
        "left.",
        variables=standard_variables(), rows=(queue_row, refusal_row, share_row, batch_row))


# ---- shunter-rollouts ------------------------------------------------------------------------------

def rollout_phase_query() -> str:
    """The phase as one number per model (1 = the first phase, ...), so a state timeline shows one band
    per model; the gauge itself is 1 on its phase's series and 0 on the others."""
    def in_phase(phase: str) -> str:
        return gauge_max("shunter_rollout_phase", f'{MODEL}, phase="{phase}"', ("model",)) + " == 1"

    return " or ".join(f"({in_phase(phase)}) * {code}" for code, phase in enumerate(ROLLOUT_PHASES, start=1))


def rollouts() -> Json:
    phases = [State(code, phase.replace("_", " "), PHASE_COLORS.get(phase, "text"))
              for code, phase in enumerate(ROLLOUT_PHASES, start=1)]
    gate = "shunter_rollout_gate"
    state_row = Row("State", (
        state_timeline("Rollout phase", "Phase of each model's latest rollout: deploying (the new version "
                       "starts at weight 0), shifting (traffic moves through the steps), promoted or rolling "
                       "back (the losing version drains), done.",
                       [Query(rollout_phase_query(), "{{model}}")], phases, height=5),
        timeseries("Rollout step", "The step a rollout holds (1-based; 0 when not shifting).",
                   [Query(gauge_max("shunter_rollout_step", MODEL, ("model",)), "{{model}}")],
                   width=8, legend_calcs=("lastNotNull",)),
        weight_panel("Traffic weight per version", MODEL_VERSION, width=16),
    ))
    gate_row = Row("Gates (latest judgement)", (
        timeseries("Gate: error rate, new vs old", "Error rates of the new and the old version over the "
                   "latest judged step's window; the step fails when new exceeds old by more than "
                   "max_error_rate_increase.",
                   [Query(gauge_max(gate, f'{MODEL}, gate=~"(new|old)_error_rate"', ("model", "gate")),
                          "{{model}} {{gate}}")], unit=PERCENT_UNIT, width=8),
        timeseries("Gate: p95 latency, new vs old", "TTFT and end-to-end p95 of the new and the old version "
                   "in the latest judged window, from the gateway's own per-request measurements; the step "
                   "fails past max_ttft_p95_ratio / max_e2e_p95_ratio.",
                   [Query(gauge_max(gate, f'{MODEL}, gate=~"(new|old)_(ttft|e2e)_p95_s"', ("model", "gate")),
                          "{{model}} {{gate}}")], unit=SEC, width=8),
        timeseries("Gate: requests judged", "Requests of each version in the latest judged window; a step "
                   "with fewer than gates.min_requests on the new version waits (then rolls back at "
                   "max_hold_s).",
                   [Query(gauge_max(gate, f'{MODEL}, gate=~"(new|old)_requests"', ("model", "gate")),
                          "{{model}} {{gate}}")], width=8),
        timeseries("Rollout decisions", "Decisions over the trailing rate window ($__rate_interval): ready, step, promote, rollback, done, "
                   "pause, resume. Each is logged by the control actor with its reason.",
                   [Query(increase("shunter_rollout_decisions_total", MODEL, ("model", "decision")),
                          "{{model}} {{decision}}")], bars=True, width=24, height=6),
    ))
    version_row = Row("Versions side by side", (
        error_ratio_panel("Error ratio by version", MODEL_VERSION, ("model", "version"), "{{model}} {{version}}"),
        timeseries("TTFT p95 by version", "95th percentile time to first token of each version, from the "
                   "Prometheus histogram (coarser than the gates' own per-request p95).",
                   [Query(quantile(0.95, "shunter_time_to_first_token_seconds", MODEL_VERSION,
                                   ("model", "version")), "{{model}} {{version}}")], unit=SEC),
    ))
    return dashboard(
        uid="shunter-rollouts", title="Shunter / Rollouts",
        description="Rollouts as the control actor runs them: phase, step and weights, the gate values it "
        "judged, its decisions, and the versions' errors and latency side by side.",
        variables=standard_variables(version_source="shunter_traffic_weight"),
        rows=(state_row, gate_row, version_row))


DASHBOARDS: tuple[Callable[[], Json], ...] = (overview, model, routing, capacity, flow, rollouts)


def all_dashboards() -> list[Json]:
    return [build() for build in DASHBOARDS]
