"""Gateway: the HTTP ingress, a Ray Serve deployment in front of every model's ModelServer deployments.

This module only wires one gateway replica together; each concern has its own module:
- `api_app`: the FastAPI app and the one error shape for what no route answers; `openapi`: its document,
  from the models that validate;
- `openai_routes`, `admin_routes`, `lora_routes`, `files_routes`, `batch_routes`, `usage_routes`: the routes, plain
  FastAPI functions that check the caller and delegate (an API route names its endpoint's descriptor,
  `shunter.endpoints`); `usage_params`: the usage endpoints' query parameters;
- `batch_lines`: a batch's lines (run by the head node's BatchService) through the same door and pipeline;
- `request_body`, `parsed_request`: reading and checking a body (size, time, JSON), then vLLM's model, once;
- `context`: one request's typed context, from the door to its outcome;
- `forward`: one API request's pipeline: the door's checks, route, admit, attempt, fail over;
- `replica_call`, `replica_stream`: starting a request on one version's replicas, with failover, and every
  wait for a replica's next item bounded;
- `relay`, `stream_account`: a started stream, to the client as bytes, and how it ends; the usage and the
  in-band error the replica sends beside its chunks;
- `request_end`: the request's one `Outcome`, recorded once, and the hooks registered on it (the replica's
  release, breaker, rollout, admission, telemetry, quota);
- `serving_state`: per model and version, the routing state, admission gate, flow queue and drain
  tracker (`flow.admission`, `flow.queue`, `draining`); `flow`: flow control, one room (the class at the
  door, the gate, the flow queue, the places kept for retries), called through `flow.door.FlowControl`; `access` and `quotas`:
  keys, limits and per-key budgets; `usage`: one usage record per settled request, batched to the usage
  ledger (shunter.deployments.ledger).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from shunter import ray_compat
from shunter.auth import open_public_bind
from shunter.config import ShunterConfig
from shunter.deployments.gateway import (
    admin_routes,
    batch_routes,
    files_routes,
    lora_routes,
    openai_routes,
    parsed_request,
    usage_routes,
)
from shunter.deployments.gateway.access import AccessControl
from shunter.deployments.gateway.api_app import app
from shunter.deployments.gateway.batch_lines import BatchLines
from shunter.deployments.gateway.forward import Forwarder
from shunter.deployments.gateway.lora import LiveAdapters
from shunter.deployments.gateway.parts import GatewayParts
from shunter.deployments.gateway.rate_headers import RateLimitHeaders
from shunter.deployments.gateway.replica_admin import ReplicaAdmin
from shunter.deployments.gateway.request_body import BodyReader
from shunter.deployments.gateway.request_end import SettleUnsettled
from shunter.deployments.gateway.serving_state import ServingState
from shunter.deployments.gateway.tiering import Tiering
from shunter.deployments.gateway.traffic import LiveVersions
from shunter.deployments.gateway.usage import UsageWriter
from shunter.ops.backlog import BacklogReporter
from shunter.tracing import correlate_logs, setup_tracing

log = logging.getLogger("ray.serve")

USAGE_FLUSH_ON_STOP_S = 2.0  # how long a stopping gateway tries to hand its buffered usage records over

app.include_router(openai_routes.router)
app.include_router(admin_routes.router)
app.include_router(lora_routes.router)
app.include_router(files_routes.router)
app.include_router(batch_routes.router)
app.include_router(usage_routes.router)
app.add_middleware(SettleUnsettled)  # every request settles once, even one whose stream never started
app.add_middleware(RateLimitHeaders)  # a known caller's x-ratelimit-* headers on every response


def _http_host() -> str | None:
    """The address Serve's HTTP proxies listen on (the Serve config's `http_options.host`). Ray has no
    public call for it: `shunter.ray_compat.serve_http_host`."""
    try:
        return ray_compat.serve_http_host()
    except Exception:  # noqa: BLE001 - outside a Serve cluster (unit tests): nothing to check
        log.warning("could not read Serve's HTTP host; the keyless-public-bind check is skipped", exc_info=True)
        return None


def _report_backlog(reporter: BacklogReporter, backlog: tuple[dict[str, int], dict[str, int]]) -> None:
    try:
        reporter.report(*backlog)
    except Exception:  # noqa: BLE001 - the GCS briefly unreachable: the next second tries again
        log.warning("could not report the gateway's backlog to the autoscaler", exc_info=True)


@serve.deployment
@serve.ingress(app)
class Gateway:
    _usage_closed = False

    def __init__(self, config: dict[str, Any], model_servers: dict[str, dict[str, DeploymentHandle]],
                 ledger: DeploymentHandle | None = None, batch: DeploymentHandle | None = None):
        """`model_servers`: model -> version -> the handle of that version's ModelServer deployment;
        `ledger`: the UsageLedger deployment's (None: usage.enabled is false); `batch`: the BatchService
        deployment's (None: batch.enabled is false)."""
        cfg = ShunterConfig.model_validate(config)
        refusal = open_public_bind(_http_host(), cfg.auth)
        if refusal is not None:
            raise RuntimeError(refusal)
        access = AccessControl(cfg)  # reads the keys: a key that cannot be read stops us here
        tiering = Tiering(cfg) if cfg.tiers else None
        parsed_request.warm_up()  # vLLM's request models: imported once here, not by the first request
        setup_tracing(cfg.observability.tracing, "gateway")
        correlate_logs()
        any_handle = next(iter(next(iter(model_servers.values())).values()))
        backlog = BacklogReporter(any_handle.app_name, uuid.uuid4().hex)

        def refreshed(control: dict[str, Any]) -> None:  # once a second, on the event loop
            replicas.apply_cordons(control, cfg.models)
            replicas.apply_serving(traffic.serving_sets, cfg.models)
            adapters.refresh(control)
            # The autoscaling policy counts the requests waiting here (a blocking store write: off the loop).
            asyncio.get_running_loop().run_in_executor(None, _report_backlog, backlog, state.backlog())

        traffic = LiveVersions(any_handle.app_name, cfg,
                               {m: {v: h.deployment_name for v, h in versions.items()}
                                for m, versions in model_servers.items()}, on_refresh=refreshed)
        state = ServingState(cfg, model_servers, traffic)
        replicas = ReplicaAdmin(traffic, model_servers, state.routing)
        body = BodyReader(cfg.gateway)
        adapters = LiveAdapters(cfg)
        usage = UsageWriter(cfg.usage, ledger) if ledger is not None else None
        forwarder = Forwarder(cfg, access, body, state, traffic, tiering, adapters, usage)
        self.parts = GatewayParts(
            config=cfg, access=access, body=body, state=state, traffic=traffic, replicas=replicas,
            forwarder=forwarder, tiering=tiering, adapters=adapters, servers=model_servers, created=int(time.time()),
            usage=usage, batch=batch)
        self.batch_lines = BatchLines(forwarder, access)

    # Called by the BatchService (shunter.deployments.batch) through this deployment's handle.

    async def check_batch_lines(self, owner: str, url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
        """Each body's refusal as its endpoint would answer it, or None (shunter.deployments.gateway.batch_lines)."""
        return await self.batch_lines.check(owner, url, bodies)

    async def run_batch_line(self, owner: str, url: str, body: dict[str, Any], line_id: str) -> dict[str, Any]:
        """One batch line through this gateway's path, answered as data."""
        return await self.batch_lines.run(owner, url, body, line_id)

    async def __del__(self) -> None:
        """Serve awaits this once the replica's requests drained (scale-down, update, shutdown): the usage
        records still buffered go to the ledger first, within USAGE_FLUSH_ON_STOP_S."""
        parts = getattr(self, "parts", None)
        if parts is not None and parts.usage is not None and not self._usage_closed:
            self._usage_closed = True
            await parts.usage.close(USAGE_FLUSH_ON_STOP_S)
