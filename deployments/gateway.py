"""Gateway: the HTTP ingress. OpenAI endpoints, input checks, model resolution, streaming, errors.

What the gateway decides itself, before any engine sees the request: who is calling and what they may
use (401, 403: shunter.deployments.access, checked before the body is read), body size (413), encoding and
JSON syntax (400), the `model` field (400 missing, 404 unknown; `model: auto` resolved to a tier by
shunter.deployments.tiering), whether the model serves this endpoint (400), the request limits (400) and the
caller's quota (429). Everything about the request's content (messages, sampling parameters, context
length) is checked by vLLM's own request models inside the replica, which answers OpenAI-shaped errors
with their status. Every error leaves here as `{"error": {...}}`; nothing leaks a pydantic dump.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from shunter.auth import Caller, open_public_bind
from shunter.config import DEFAULT_VERSION, ModelConfig, RolloutConfig, ShunterConfig, format_config_error
from shunter.deployments import parsed_request
from shunter.deployments.access import AccessControl
from shunter.deployments.admin_schema import DrainBody, RolloutStartBody, WeightsBody, parse_body
from shunter.deployments.openai_schema import (
    BEARER,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    add_components,
    request_body,
)
from shunter.deployments.replica_admin import ReplicaAdmin
from shunter.deployments.telemetry import (
    STREAM_ERROR,
    RequestTelemetry,
    ask_for_usage,
    replicas_routable,
)
from shunter.deployments.tiering import Tiering
from shunter.deployments.traffic import LiveVersions
from shunter.errors import ApiError, error_body
from shunter.ops import metrics as ops_metrics
from shunter.ops.admission import AdmissionGate
from shunter.ops.draining import DrainTracker
from shunter.replica_protocol import Accepted, ReplicaRequest, RequestLimits, Working
from shunter.routing.failover import ReplicaFailure, with_failover
from shunter.routing.state import DeploymentRouting, deployment_key, routing_state
from shunter.routing.tiers import Decision
from shunter.routing.versions import choose_version
from shunter.tracing import correlate_logs, setup_tracing

log = logging.getLogger("ray.serve")

# Which model task serves which endpoint.
_ENDPOINT_TASK = {"chat": "generate", "completion": "generate", "embedding": "embed"}
_RETRY_AFTER_S = "5"
MAX_JSON_DEPTH = 64
FAST_BODY_S = 0.5  # a body still arriving after this needs an upload slot (gateway.max_body_reads)
_PARSE_INLINE_BYTES = 64 * 1024  # bodies up to this are validated on the event loop (well under 1 ms)
REPLICA_HEADER = "x-shunter-replica"  # which replica served the request: for operators and tests
VERSION_HEADER = "x-shunter-version"  # which version of the model served it
SESSION_HEADER = "x-shunter-session"  # requests with the same value (or the same `user`) stay on one version

app = FastAPI(title="Shunter", description="OpenAI-compatible multi-model gateway", docs_url=None, redoc_url=None)


def _openapi() -> dict[str, Any]:
    """FastAPI's document plus the request bodies the routes read themselves, and the bearer scheme."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        app.openapi_schema = add_components(get_openapi(title=app.title, version="1", description=app.description,
                                                        routes=app.routes))
    return app.openapi_schema


app.openapi = _openapi  # type: ignore[method-assign]
_KEYED = {"security": [{BEARER: []}]}


def _error(status: int, message: str, param: str | None = None, code: str | int | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param=param, code=code), status_code=status, headers=headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _error(400, "invalid request")


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error in gateway for %s %s", request.method, request.url.path)
    return _error(500, "internal error in the gateway; see the server log")


def _request_id() -> str:
    """Ray Serve's id of the request being handled (from the client's `X-Request-ID`, or made by Serve's
    proxy, which returns it in the response's `x-request-id`), so Serve's access log, Shunter's logs
    and spans, and the client all name a request the same way."""
    try:
        from ray.serve.context import _get_serve_request_context

        request_id = _get_serve_request_context().request_id
    except Exception:  # noqa: BLE001 - outside a Serve request (unit tests)
        request_id = ""
    return request_id or uuid.uuid4().hex


def _http_host() -> str | None:
    """The address Serve's HTTP proxies listen on (the Serve config's `http_options.host`). Ray has no
    public call for it; its client's copy of the HTTP options is read here, in this one place."""
    try:
        from ray.serve.context import _get_global_client

        return _get_global_client().http_config.host
    except Exception:  # noqa: BLE001 - outside a Serve cluster (unit tests): nothing to check
        log.warning("could not read Serve's HTTP host; the keyless-public-bind check is skipped", exc_info=True)
        return None


def _nesting_depth(value: Any) -> int:
    """Depth of nested lists/dicts, computed without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _require_json(request: Request, optional: bool) -> None:
    """POST and PUT bodies are JSON, said so by Content-Type (415 otherwise). Browsers send text/plain
    and form bodies to other sites without asking first; JSON needs a preflight this gateway never
    grants, so no web page a user opens can call it. `optional`: a request with no body at all may
    leave the header out only when it carries a key (which a cross-site page cannot add)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json" or (kind == "" and optional and _bodiless(request)
                                      and "authorization" in request.headers):
        return
    raise ApiError(415, f"send the body as JSON with `Content-Type: application/json` (got "
                   f"{kind or 'no Content-Type'})", code="unsupported_media_type")


def _bodiless(request: Request) -> bool:
    headers = request.headers
    return headers.get("content-length") in (None, "0") and "transfer-encoding" not in headers


async def _collect(request: Request, limit: int, chunks: list[bytes]) -> None:
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)


def _engine_failure(error: dict[str, Any] | None) -> str | None:
    """The message of an in-band stream error that is the engine's failure (a 5xx code), else None (no
    error, or a client error such as a bad tool-call argument found mid-stream)."""
    if error is None:
        return None
    code = error.get("code")
    if isinstance(code, int) and code < 500:
        return None
    return str(error.get("message") or code or "engine error")[:300]


def _model_field(body: dict[str, Any]) -> str:
    name = body.get("model")
    if name is None:
        raise ApiError(400, "missing required field 'model'", param="model", code="missing_field")
    if not isinstance(name, str):
        raise ApiError(400, f"'model' must be a string, got {type(name).__name__}", param="model",
                       code="invalid_type")
    return name


def _cancel(stream: Any) -> None:
    """Cancel a replica response; a response that already failed may raise its error again here."""
    if stream is None:
        return
    try:
        stream.cancel()
    except Exception:  # noqa: BLE001 - nothing is left to cancel
        pass


@dataclass
class _Started:
    """A reply whose replica has answered: its head, and for a stream the first chunk already read."""

    replica: str
    head: dict[str, Any]
    stream: Any
    first_chunk: str | None
    routing_id: str  # this attempt's id in the routing state (each attempt has its own)


class _RelayEnd:
    """What must happen exactly once when a relayed stream ends, however it ends: cancel the replica's
    work unless the stream finished, count the drain, give the admission slot back. A client that goes
    away before the response starts means the relay generator never runs (so its `finally` never does
    either); then this object's `__del__`, when the unstarted generator is dropped, does it instead."""

    def __init__(self, started: _Started, routing: DeploymentRouting, drains: DrainTracker, gate: AdmissionGate,
                 on_outcome: Callable[[bool], None] | None = None, tel: RequestTelemetry | None = None):
        self.stream, self.replica, self.routing_id = started.stream, started.replica, started.routing_id
        self.routing, self.drains, self.gate = routing, drains, gate
        self.on_outcome = on_outcome
        self.tel = tel
        self.done = False
        drains.opened(self.replica)

    def close(self, finished: bool = False, aborted: bool = False, ok: bool | None = None,
              cut: bool = False) -> None:
        """`ok`: whether the stream was served whole (True) or broke (False); None when neither says
        anything about the version (the client left, the platform drained the replica, a limit cut it:
        `cut`)."""
        if self.done:
            return
        self.done = True
        if not finished:  # client disconnected or we were cancelled: abort the engine request
            _cancel(self.stream)
        self.drains.closed(self.replica, self.routing.departed_at(self.replica), aborted)
        self.routing.finished(self.routing_id)
        self.gate.release()
        if ok is not None and self.on_outcome is not None:
            self.on_outcome(ok)
        if self.tel is not None:
            # 499: the client closed the connection first (nginx's name for it).
            self.tel.finish(200 if ok else STREAM_ERROR if (ok is False or aborted or cut) else 499)

    def __del__(self) -> None:
        self.close()


class _QueueTimeout(Exception):
    """No replica took the request within gateway.queue_timeout_s (or, for a model scaled to zero, within
    autoscaling.cold_start_timeout_s)."""

    def __init__(self, waited_s: float, cold_start: bool):
        super().__init__(waited_s, cold_start)
        self.waited_s = waited_s
        self.cold_start = cold_start


class _DrainTimeout(Exception):
    """The replica left (scale-down, update, shutdown) and the request ran past the drain timeout."""


class _RequestDeadline(Exception):
    """The request ran past gateway.limits.request_timeout_s."""


class _StreamIdle(Exception):
    """The stream sent nothing for gateway.limits.stream_idle_timeout_s (shorter than the model's
    replica_timeout_s, which would count as the replica's failure)."""


class _AllReplicasOut(Exception):
    """Every replica's breaker is open: nothing to send to, or to retry on."""


class _NoReplica(Exception):
    """The request failed before any replica took it (none running, deployment failed)."""


class _VersionFailed(Exception):
    """The request could not start on one version (before any byte reached the client); carries the
    response the client gets if no other version can take it."""

    def __init__(self, response: JSONResponse):
        super().__init__(response.status_code)
        self.response = response


@serve.deployment
@serve.ingress(app)
class Gateway:
    def __init__(self, config: dict[str, Any], model_servers: dict[str, dict[str, DeploymentHandle]]):
        """`model_servers`: model -> version -> the handle of that version's ModelServer deployment."""
        self.config = ShunterConfig.model_validate(config)
        refusal = open_public_bind(_http_host(), self.config.auth)
        if refusal is not None:
            raise RuntimeError(refusal)
        self.access = AccessControl(self.config)  # reads the keys: a key that cannot be read stops us here
        limits = self.config.gateway.limits
        self.replica_limits = RequestLimits(max_tokens=limits.max_tokens, max_prompt_tokens=limits.max_prompt_tokens)
        self.tiering = Tiering(self.config) if self.config.tiers else None
        self._background: set[asyncio.Task] = set()  # the tier monitor's comparisons, kept referenced
        parsed_request.warm_up()  # vLLM's request models: imported once here, not by the first request
        setup_tracing(self.config.observability.tracing, "gateway")
        correlate_logs()
        self.servers = model_servers
        self.created = int(time.time())
        any_handle = next(iter(next(iter(model_servers.values())).values()))
        self._routing: dict[str, DeploymentRouting] = {}
        self.traffic = LiveVersions(any_handle.app_name, self.config,
                                    {m: {v: h.deployment_name for v, h in versions.items()}
                                     for m, versions in model_servers.items()},
                                    on_refresh=lambda state: self.replicas.apply_cordons(state, self.config.models))
        self.replicas = ReplicaAdmin(self.traffic, model_servers, self._routing_state)
        self._gates: dict[str, AdmissionGate] = {}
        self._drains: dict[str, DrainTracker] = {}
        self._routable: dict[tuple[str, str], int] = {}  # last exported replica counts
        self._upload_slots = asyncio.Semaphore(self.config.gateway.max_body_reads)

    # ---- probes ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        """The gateway process is alive. Says nothing about the engines: see /ready."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self, request: Request) -> JSONResponse:
        """200 when every model has a replica that has answered a real request; 503 otherwise. The
        details (per model: versions, replica, process, cores, placement, reasons) only for an admin key
        (anyone when no key is configured); a probe without one gets `{"ready": ...}` alone."""
        timeout = self.config.gateway.ready_timeout_s

        self.traffic.ensure_started()

        async def probe_version(model: ModelConfig, version: str) -> tuple[dict[str, Any] | None, str | None]:
            if self._scaled_to_zero(model, self._routing_state(model, version)):
                # Probing would start a replica; a model allowed to scale to zero starts on demand.
                return {"replicas": 0, "starts_on_demand": True}, None
            try:
                return await asyncio.wait_for(self.servers[model.name][version].ready.remote(), timeout), None
            except asyncio.TimeoutError:
                return None, f"no replica answered within {timeout}s"
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready", with the reason shown
                return None, f"{type(exc).__name__}: {exc}"[:300]

        async def probe(model: ModelConfig) -> tuple[str, dict[str, Any] | None, str | None]:
            """A model is ready when every version that takes traffic has a replica that answers."""
            versions = self.traffic.serving(model)
            if not versions:  # live weights that name no running version: nothing can serve it
                return model.name, None, "no version of the model takes traffic (see GET /admin/rollouts)"
            answers = await asyncio.gather(*(probe_version(model, v) for v in versions))
            failed = [f"version {v}: {why}" if model.versioned else why
                      for v, (_, why) in zip(versions, answers, strict=True) if why]
            if failed:
                return model.name, None, "; ".join(failed)
            if not model.versioned:
                return model.name, answers[0][0], None
            return model.name, {"versions": {v: info for v, (info, _) in zip(versions, answers, strict=True)}}, None

        results = await asyncio.gather(*(probe(m) for m in self.config.models))
        models = {name: ({"ready": True, **info} if info else {"ready": False, "reason": why})
                  for name, info, why in results}
        ok = all(m["ready"] for m in models.values())
        headers = None if ok else {"Retry-After": _RETRY_AFTER_S}
        answer = {"ready": ok, "models": models} if self.access.sees_details(request.headers) else {"ready": ok}
        return JSONResponse(answer, status_code=200 if ok else 503, headers=headers)

    # ---- OpenAI API -----------------------------------------------------------------------------

    @app.get("/v1/models", openapi_extra=_KEYED)
    async def list_models(self, request: Request) -> dict[str, Any]:
        """The models the caller's key may use."""
        caller = self.access.client(request.headers)
        cards = [self._model_card(m) for m in self.config.models if caller.may_use(m.name)]
        if self.tiering and any(caller.may_use(t.model) for t in self.tiering.router.tiers):
            cards.append(self._tier_card())
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model_id:path}", openapi_extra=_KEYED)
    async def get_model(self, model_id: str, request: Request) -> Response:
        caller = self.access.client(request.headers)
        if self.tiering and model_id == self.tiering.name:
            return JSONResponse(self._tier_card())
        model = self.config.find_model(model_id)
        if model is None:
            return _error(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")
        self.access.check_model(caller, model.name)
        return JSONResponse(self._model_card(model))

    def _tier_card(self) -> dict[str, Any]:
        assert self.tiering is not None
        return {"id": self.tiering.name, "object": "model", "created": self.created, "owned_by": "shunter",
                "aliases": [], "task": "generate", "tiers": [t.name for t in self.tiering.router.tiers]}

    def _model_card(self, model: ModelConfig) -> dict[str, Any]:
        card = {"id": model.name, "object": "model", "created": self.created, "owned_by": "shunter",
                "aliases": model.aliases, "task": model.task}
        if model.versioned:
            card["versions"] = [{"name": v, "weight": w} for v, w in self.traffic.view(model).weights]
        return card

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward(request, "chat")

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        return await self._forward(request, "completion")

    @app.post("/v1/embeddings", openapi_extra=request_body(EmbeddingRequest))
    async def embeddings(self, request: Request) -> Response:
        return await self._forward(request, "embedding")

    # ---- admin API: rollouts and live weights (an admin key when keys are configured) -----------------

    @app.get("/admin/rollouts")
    async def list_rollouts(self, request: Request) -> dict[str, Any]:
        """Every versioned model: its live weights and its latest rollout."""
        self.access.admin(request.headers)
        await self.traffic.refresh_now()
        return {"models": [self._rollout_status(m) for m in self.config.models if m.versioned]}

    @app.post("/admin/rollouts/{model_id:path}/pause")
    async def pause_rollout(self, model_id: str, request: Request) -> Response:
        self.access.admin(request.headers)
        await self._read_json(request, optional=True)  # JSON or nothing: never a cross-site form
        return await self._control_call(model_id, "pause")

    @app.post("/admin/rollouts/{model_id:path}/resume")
    async def resume_rollout(self, model_id: str, request: Request) -> Response:
        self.access.admin(request.headers)
        await self._read_json(request, optional=True)  # JSON or nothing: never a cross-site form
        return await self._control_call(model_id, "resume")

    @app.post("/admin/rollouts/{model_id:path}/rollback")
    async def rollback_rollout(self, model_id: str, request: Request) -> Response:
        self.access.admin(request.headers)
        await self._read_json(request, optional=True)  # JSON or nothing: never a cross-site form
        return await self._control_call(model_id, "rollback")

    @app.get("/admin/rollouts/{model_id:path}")
    async def get_rollout(self, model_id: str, request: Request) -> Response:
        self.access.admin(request.headers)
        model = self.config.find_model(model_id)
        if model is None:
            return _error(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")
        await self.traffic.refresh_now()
        return JSONResponse(self._rollout_status(model))

    @app.post("/admin/rollouts/{model_id:path}", openapi_extra=request_body(RolloutStartBody))
    async def start_rollout(self, model_id: str, request: Request) -> Response:
        """Body: {"to": VERSION} plus any of the model's `rollout` settings to use for this rollout only
        (steps, hold_s, max_hold_s, ready_timeout_s, gates)."""
        self.access.admin(request.headers)
        body = parse_body(RolloutStartBody, await self._read_json(request))
        return await self._control_call(model_id, "start", to=body.to, overrides=body.model_extra or {})

    @app.get("/admin/tiers")
    async def tier_status(self, request: Request) -> Response:
        """Tier routing: the tiers, the classes the monitor promoted, its windows."""
        self.access.admin(request.headers)
        if self.tiering is None:
            return _error(404, "tier routing is off (no `tiers:` in the config)", code="tiers_off")
        return JSONResponse(self.tiering.status())

    @app.put("/admin/models/{model_id:path}/weights", openapi_extra=request_body(WeightsBody))
    async def set_weights(self, model_id: str, request: Request) -> Response:
        """Body: {"weights": {VERSION: WEIGHT, ...}}. Versions given a weight above 0 run; the others are
        retired. Refused while a rollout of the model is in progress."""
        self.access.admin(request.headers)
        body = parse_body(WeightsBody, await self._read_json(request))
        return await self._control_call(model_id, "weights", weights=list(body.weights.items()))

    # ---- admin API: replicas (drain one: no new requests, then Ray Serve replaces it once idle) ---------

    @app.get("/admin/models/{model_id:path}/replicas")
    async def list_replicas(self, model_id: str, request: Request) -> Response:
        """The model's running replicas as this gateway routes to them: version, cordoned, requests it
        has in flight there, breaker state."""
        self.access.admin(request.headers)
        model = self._admin_model(model_id)
        self.traffic.ensure_started()
        await self.traffic.refresh_now()
        return JSONResponse({"model": model.name, "replicas": await self.replicas.replicas(model)})

    @app.post("/admin/models/{model_id:path}/replicas/{replica_id}/drain", openapi_extra=request_body(DrainBody))
    async def drain_replica(self, model_id: str, replica_id: str, request: Request) -> Response:
        """Body (optional): {"replace": true, "timeout_s": the model's draining.timeout_s, "force": false}.
        Cordons the replica on every gateway; with `replace`, Ray Serve replaces it once it holds no
        request (at the latest after timeout_s). Refused for the last routable replica without `force`,
        and while the model has a rollout in progress."""
        self.access.admin(request.headers)
        body = parse_body(DrainBody, await self._read_json(request, optional=True))
        model = self._admin_model(model_id)
        within_s = body.timeout_s if body.timeout_s is not None else model.draining.timeout_s
        self.traffic.ensure_started()
        answer = await self.replicas.drain(model, replica_id, body.replace, float(within_s), body.force)
        return JSONResponse(answer, status_code=202)

    @app.delete("/admin/models/{model_id:path}/replicas/{replica_id}/drain")
    async def release_replica(self, model_id: str, replica_id: str, request: Request) -> Response:
        """Undo a drain: the replica takes new requests again and, if it was to retire, stays."""
        self.access.admin(request.headers)
        model = self._admin_model(model_id)
        return JSONResponse(await self.replicas.release(model, replica_id))

    def _admin_model(self, model_id: str) -> ModelConfig:
        model = self.config.find_model(model_id)
        if model is None:
            raise ApiError(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")
        return model

    async def _control_call(self, model_id: str, action: str, **kwargs: Any) -> Response:
        from shunter.ops.control import RolloutRefused

        model = self.config.find_model(model_id)
        if model is None:
            return _error(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")
        if not model.versioned:
            return _error(400, f"model {model.name!r} has one version; declare `versions:` in its config to roll "
                          "out between them", param="model", code="not_versioned")
        actor = self.traffic.actor()
        if action == "start":
            overrides = kwargs["overrides"]
            try:  # the same checks as the config file's `rollout:` section
                merged = RolloutConfig.model_validate({**model.rollout.model_dump(mode="json"), **overrides})
            except ValidationError as exc:
                return _error(400, format_config_error(exc, RolloutConfig).replace("\n", " "), code="invalid_rollout")
            call = actor.start_rollout.remote(self.traffic.context(model), kwargs["to"], merged.model_dump(mode="json"))
        elif action == "weights":
            call = actor.set_weights.remote(self.traffic.context(model), kwargs["weights"])
        elif action == "rollback":
            call = actor.rollback.remote(model.name)
        else:
            call = getattr(actor, action).remote(model.name)
        try:
            await call
        except RolloutRefused as exc:  # raised in the actor; Ray re-raises it here as that class
            cause = getattr(exc, "cause", None) or exc
            return _error(409, str(cause), param="model", code="rollout_refused")
        except Exception as exc:  # noqa: BLE001 - the control actor is restarting or unreachable
            log.warning("model %s: rollout %s failed: %r", model.name, action, exc)
            return _error(503, f"the rollout controller did not answer ({type(exc).__name__}); retry shortly",
                          code="control_unavailable", headers={"Retry-After": _RETRY_AFTER_S})
        await self.traffic.refresh_now()
        return JSONResponse(self._rollout_status(model), status_code=202 if action == "start" else 200)

    def _rollout_status(self, model: ModelConfig) -> dict[str, Any]:
        view = self.traffic.view(model)
        entry = (self.traffic.state.get("rollouts") or {}).get(model.name)
        current = entry is not None and entry["context"].get("fingerprint") == model.fingerprint
        return {"model": model.name, "versions": model.version_names(),
                "weights": [{"version": v, "weight": w} for v, w in view.weights], "live": sorted(view.live),
                "weights_from": view.source, "rollout": entry["rollout"] if current else None}

    # ---- forwarding -----------------------------------------------------------------------------

    async def _forward(self, request: Request, endpoint: str) -> Response:
        caller = self.access.client(request.headers)  # before the body is read: strangers cost nothing
        body = await self._read_json(request)
        name = _model_field(body)
        # Validate once, on typed values: every decision below reads the parsed request.
        parsed = await self._parse(request, endpoint, body)
        body = parsed.body
        tier = None
        if self.tiering is not None and name == self.tiering.name:
            tier = self.tiering.classify(endpoint, body, request.headers, caller.may_use)
            name = tier.tier.model
        model = self._resolve_model(name, endpoint, caller)
        self.access.check_model(caller, model.name)
        self.access.check_limits(parsed)
        body = {**body, "model": model.name}  # the engine knows the canonical name only
        tel = RequestTelemetry(model.name, endpoint, request.headers, _request_id(), parsed.usage_chunk,
                               log_prompt=self._prompt_for_logs(body), continuous_usage=parsed.continuous_usage)
        tel.choices_per_prompt = parsed.n
        if tier is not None:
            self._follow_tier(tier, endpoint, body, tel)
        try:
            ticket = self.access.admit(caller, model.name, parsed, model.engine.max_model_len)
        except ApiError as refused:
            tel.finish(refused.status)
            raise
        tel.on_finish.append(ticket.settle)
        limits = RequestLimits(max_tokens=ticket.default_max_tokens,
                               max_prompt_tokens=self.config.gateway.limits.max_prompt_tokens)
        timeout = self.config.gateway.limits.request_timeout_s
        with tel.use():
            try:
                response = await asyncio.wait_for(self._admit(request, model, endpoint, body, tel, limits), timeout)
            except asyncio.TimeoutError:
                log.warning("model %s request %s: no reply within the request timeout of %gs", model.name,
                            tel.request_id, timeout)
                response = _error(504, f"the request to model {model.name!r} did not finish within the request "
                                  f"timeout of {timeout:g}s", code="request_timeout")
        response.headers.update(ticket.headers)
        if tier is not None:
            response.headers.update(self.tiering.headers(tier))  # type: ignore[union-attr]
        if not isinstance(response, StreamingResponse):  # a stream finishes when its relay ends
            tel.finish(response.status_code)
        return response

    def _follow_tier(self, tier: Decision, endpoint: str, body: dict[str, Any], tel: RequestTelemetry) -> None:
        """A tier-routed request: its decision on the trace, its tokens and cost when it ends, and, for a
        sampled one, the monitor's comparison of both tiers once it has been answered."""
        tiering = self.tiering
        assert tiering is not None
        tel.span.set_attributes({"shunter.tier": tier.tier.name, "shunter.tier.class": tier.request_class,
                                 "shunter.tier.complexity": tier.complexity, "shunter.tier.reason": tier.reason})
        tel.on_finish.append(lambda status, prompt, completion: tiering.finished(tier, status, prompt, completion))
        if not tiering.sampled(tier):
            return
        asked = dict(body)

        def compare(status: int | str, prompt: int, completion: int) -> None:
            if str(status) != "200":
                return
            try:
                task = asyncio.get_running_loop().create_task(
                    tiering.judge(tier, endpoint, asked, self._ask_internal))
            except RuntimeError:  # finished outside the event loop (a dropped relay): skip the sample
                return
            self._background.add(task)
            task.add_done_callback(self._background_done)

        tel.on_finish.append(compare)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("tier monitor: a comparison failed: %r", task.exception())

    async def _ask_internal(self, model_name: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """One whole (not streamed) request of the platform's own, through the model's routing and
        failover like any other; counted under endpoint `tier_monitor`. Skipped (None) when the model is
        at its admission bound: monitoring never adds to an overload."""
        model = self.config.find_model(model_name)
        if model is None:
            return None
        versions = self._versions_for(model, None, body)
        gate = self._gate(model)
        if not versions or gate.try_admit(self._capacity(model)) is not None:
            return None
        tel = RequestTelemetry(model.name, "tier_monitor", {}, uuid.uuid4().hex)
        response: Response | None = None
        try:  # the same path as a client's whole reply: versions, failover, breakers, outcome records
            response = await self._admitted(model, endpoint, body, versions, gate, tel, self.replica_limits)
        finally:
            gate.release()
            tel.finish(response.status_code if response is not None else 503)
        return json.loads(bytes(response.body)) if response.status_code == 200 else None

    async def _admit(self, request: Request, model: ModelConfig, endpoint: str, body: dict[str, Any],
                     tel: RequestTelemetry, limits: RequestLimits) -> Response:
        self.traffic.ensure_started()
        versions = self._versions_for(model, request, body)
        if not versions:
            # Every replica's breaker is open: say so at once rather than queue behind failing replicas.
            chosen = self._versions_for(model, request, body, skip_unavailable=False)[0]
            tel.version = chosen
            return self._all_replicas_out(model, self._routing_state(model, chosen))
        tel.version = versions[0]
        gate = self._gate(model)
        capacity = self._capacity(model)
        retry_after = gate.try_admit(capacity)
        if retry_after is not None:
            ops_metrics.rejection(model.name, "queue_full")
            return _error(429, f"model {model.name!r} is overloaded: {gate.queued(capacity)} requests are "
                          f"already waiting for a replica; retry in {retry_after}s", code="queue_full",
                          headers={"Retry-After": str(retry_after)})
        tel.admitted()
        relayed = False
        try:
            response = await self._admitted(model, endpoint, ask_for_usage(body), versions, gate, tel, limits)
            relayed = isinstance(response, StreamingResponse)
            return response
        finally:
            if not relayed:  # a stream releases its admission when the relay ends
                gate.release()

    def _prompt_for_logs(self, body: dict[str, Any]) -> str | None:
        """The prompt, for logs and spans, only where the config allows it (off by default)."""
        if not self.config.observability.logging.log_prompts:
            return None
        prompt = body.get("messages", body.get("prompt", body.get("input")))
        return json.dumps(prompt)[:4096]

    def _versions_for(self, model: ModelConfig, request: Request | None, body: dict[str, Any],
                      skip_unavailable: bool = True) -> list[str]:
        """The version this request goes to under the live weights (a conversation keeps its version),
        then the other versions taking traffic, as fallbacks should it fail before its first byte.
        Versions whose every replica is out (breakers open) are left out."""
        if not model.versioned:
            chosen, others = DEFAULT_VERSION, []
        else:
            view = self.traffic.view(model)
            user = body.get("user")
            header = request.headers.get(SESSION_HEADER) if request is not None else None
            session = header or (user if isinstance(user, str) and user else None)
            chosen = choose_version(model.name, view.weights, session)
            others = [v for v, w in view.weights if w > 0 and v != chosen]
        ordered = [chosen, *others]
        if not skip_unavailable:
            return ordered
        return [v for v in ordered if self._routing_state(model, v).unavailable_for_s() is None]

    async def _admitted(self, model: ModelConfig, endpoint: str, body: dict[str, Any], versions: list[str],
                        gate: AdmissionGate, tel: RequestTelemetry, limits: RequestLimits) -> Response:
        request_id = tel.request_id
        began = time.monotonic()
        for i, version in enumerate(versions):
            routing = self._routing_state(model, version)
            try:
                started = await self._start(model, version, routing, endpoint, body, tel, limits)
            except _VersionFailed as failed:
                self.traffic.record(model, version, False, None, None)
                if i + 1 < len(versions):
                    log.warning("model %s request %s: version %s could not take it (%s); trying version %s",
                                model.name, request_id, version, failed.response.status_code, versions[i + 1])
                    continue
                return failed.response
            first_byte_s = time.monotonic() - began
            tel.answered()
            headers = {REPLICA_HEADER: started.replica, VERSION_HEADER: version}
            if not started.head["stream"]:
                tel.whole_reply(started.head["body"])
                routing.finished(started.routing_id)
                routing.record_outcome(started.replica, False)
                if started.head["status"] < 400:  # a client error says nothing about the version
                    self.traffic.record(model, version, True, None, first_byte_s)
                return JSONResponse(started.head["body"], status_code=started.head["status"], headers=headers)

            def outcome(ok: bool, version: str = version, ttft: float = first_byte_s) -> None:
                self.traffic.record(model, version, ok, ttft, time.monotonic() - began)

            if started.first_chunk is not None:  # timed on arrival, not when the relay sends it
                started.first_chunk = tel.chunk(started.first_chunk)
            relay = _RelayEnd(started, routing, self._drain_tracker(model), gate, outcome, tel)
            return StreamingResponse(self._relay(started, model, routing, relay), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        raise AssertionError("no version to send to")  # _forward never passes an empty list

    async def _start(self, model: ModelConfig, version: str, routing: DeploymentRouting, endpoint: str,
                     body: dict[str, Any], tel: RequestTelemetry, limits: RequestLimits) -> _Started:
        """Start the request on one version, failing over once between its replicas. Raises _VersionFailed
        with the client's response when the version cannot serve it."""

        def failed(failure: ReplicaFailure) -> None:
            log.warning("model %s request %s: replica %s failed before the first byte: %s", model.name,
                        tel.request_id, failure.replica, failure.why)
            routing.record_outcome(failure.replica, True, failure.why)

        async def attempt(avoid: tuple[str, ...]) -> _Started:
            if avoid and routing.unavailable_for_s() is not None:
                raise _AllReplicasOut()  # the failure just recorded opened the last breaker
            carrier = tel.routing(version, attempt=len(avoid) + 1)
            routing_id = f"{tel.routing_id}.{len(avoid) + 1}"
            try:
                return await self._attempt(model, version, routing, tel,
                                           ReplicaRequest(request_id=routing_id, avoid=avoid, endpoint=endpoint,
                                                          body=body, trace=carrier, limits=limits))
            except BaseException as exc:
                tel.attempt_failed(type(exc).__name__)
                routing.finished(routing_id)  # Ray does not always report a failed or cancelled call
                raise
            finally:
                routing.first_byte(routing_id)  # answered or failed: its prefill no longer queues anywhere

        try:
            return await with_failover(attempt, model.routing.retry_once, failed)
        except _QueueTimeout as timeout:
            if timeout.cold_start:
                ops_metrics.rejection(model.name, "cold_start_timeout")
                log.warning("model %s: no replica started within %ss of a request to the scaled-to-zero model",
                            model.name, timeout.waited_s)
                raise _VersionFailed(_error(
                    503, f"model {model.name!r} is scaled to zero and no replica started within "
                    f"{timeout.waited_s:g}s; retry shortly", code="cold_start_timeout",
                    headers={"Retry-After": _RETRY_AFTER_S})) from None
            ops_metrics.rejection(model.name, "queue_timeout")
            log.warning("model %s: no replica accepted a request within %ss", model.name, timeout.waited_s)
            raise _VersionFailed(_error(
                503, f"no replica of model {model.name!r} could take the request within {timeout.waited_s:g}s; "
                "retry shortly", code="queue_timeout", headers={"Retry-After": _RETRY_AFTER_S})) from None
        except _AllReplicasOut:
            raise _VersionFailed(self._all_replicas_out(model, routing)) from None
        except (ReplicaFailure, _NoReplica) as exc:
            if isinstance(exc, _NoReplica):
                log.warning("model %s: request failed before any replica took it: %r", model.name, exc.__cause__)
            ops_metrics.rejection(model.name, "model_unavailable")
            raise _VersionFailed(_error(
                503, f"model {model.name!r} has no replica able to serve right now; retry shortly",
                code="model_unavailable", headers={"Retry-After": _RETRY_AFTER_S})) from None

    async def _attempt(self, model: ModelConfig, version: str, routing: DeploymentRouting, tel: RequestTelemetry,
                       request: ReplicaRequest) -> _Started:
        """Send once and wait for the replica's first answer: the reply head, and for a stream its first
        chunk too, so a replica that fails before any byte reaches the client can be failed over."""
        stream = None
        try:
            stream = self.servers[model.name][version].options(stream=True).handle.remote(request)
            # A replica answers Accepted as soon as it takes the request; waiting for that is bounded, so
            # a model whose replicas cannot take work (none started, all full) is a 503, never a hang.
            cold_start = self._scaled_to_zero(model, routing)
            wait = self.config.gateway.queue_timeout_s
            if cold_start and model.autoscaling is not None:
                wait = model.autoscaling.cold_start_timeout_s
            try:
                accepted = await asyncio.wait_for(stream.__anext__(), wait)
            except asyncio.TimeoutError:
                raise _QueueTimeout(wait, cold_start) from None
            except Exception as exc:  # noqa: BLE001 - no replica, replica gone before taking it
                raise _NoReplica() from exc
            if not isinstance(accepted, Accepted):
                raise _NoReplica() from RuntimeError(f"replica protocol: expected Accepted, got {accepted!r}")
            replica, timeout = accepted.replica_id, model.routing.replica_timeout_s
            tel.accepted(replica)
            try:
                head = await self._next(stream, model, routing, replica)
                first = None
                if head["stream"]:
                    try:
                        first = await self._next(stream, model, routing, replica)
                    except StopAsyncIteration:
                        first = None
            except asyncio.TimeoutError:
                raise ReplicaFailure(replica, f"sent nothing for {timeout:g}s (hung?)") from None
            except _DrainTimeout:
                raise ReplicaFailure(replica, f"left and had not answered within the drain timeout of "
                                     f"{model.draining.timeout_s:g}s") from None
            except Exception as exc:  # noqa: BLE001 - replica died, engine raised: the replica's fault
                raise ReplicaFailure(replica, f"{type(exc).__name__}: {exc}"[:300]) from None
            if head["status"] >= 500:
                message = ((head.get("body") or {}).get("error") or {}).get("message", "")
                raise ReplicaFailure(replica, f"engine answered {head['status']}: {message}"[:300])
            return _Started(replica, head, stream, first, request.request_id)
        except BaseException:
            _cancel(stream)
            raise

    async def _next(self, stream: Any, model: ModelConfig, routing: DeploymentRouting, replica: str,
                    deadline: float = math.inf, idle_s: float = math.inf) -> Any:
        """The replica's next item. Raises asyncio.TimeoutError after `replica_timeout_s` of silence (the
        replica's failure), _StreamIdle after `idle_s` when that is shorter (the client's limit),
        _RequestDeadline at `deadline`, and _DrainTimeout once the replica has left the running set for
        longer than the drain timeout (checked every second, so a replica that leaves mid-wait is
        noticed)."""
        silence = model.routing.replica_timeout_s
        silent_until = time.monotonic() + min(silence, idle_s)
        pending = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                if pending.done() and isinstance(pending.result(), Working):  # alive: the silence starts over
                    silent_until = time.monotonic() + min(silence, idle_s)
                    pending = asyncio.ensure_future(stream.__anext__())
                now = time.monotonic()
                departed = routing.departed_at(replica)
                drain_until = departed + model.draining.timeout_s if departed is not None else math.inf
                if now >= drain_until:
                    raise _DrainTimeout()
                if now >= deadline:
                    raise _RequestDeadline()
                if now >= silent_until:
                    raise _StreamIdle() if idle_s < silence else asyncio.TimeoutError()
                done, _ = await asyncio.wait({pending}, timeout=min(silent_until, drain_until, deadline,
                                                                    now + 1.0) - now)
                if done and not isinstance(pending.result(), Working):
                    return pending.result()
        finally:
            if not pending.done():
                pending.cancel()

    async def _relay(self, started: _Started, model: ModelConfig, routing: DeploymentRouting,
                     end: _RelayEnd) -> AsyncIterator[str]:
        """SSE chunks from the replica to the client. A client that goes away cancels the replica's work;
        a replica that breaks or goes silent mid-stream ends the stream with an explicit error event, and
        so does a stream still running when its leaving replica's drain timeout is up."""
        finished = aborted = cut = False
        ok: bool | None = None  # served whole / broke; None: the client left, the platform drained or cut it
        stream, replica, timeout = started.stream, started.replica, model.routing.replica_timeout_s
        limits = self.config.gateway.limits
        deadline = (end.tel.began if end.tel is not None else time.monotonic()) + limits.request_timeout_s
        try:
            if started.first_chunk is not None:
                yield started.first_chunk
            while True:
                try:
                    chunk = await self._next(stream, model, routing, replica, deadline, limits.stream_idle_timeout_s)
                except StopAsyncIteration:
                    break
                if end.tel is not None:
                    chunk = end.tel.chunk(chunk)
                if chunk is not None:
                    yield chunk
            finished = True
            broke = _engine_failure(end.tel.in_band_error if end.tel is not None else None)
            if broke is not None:  # vLLM ends a stream whose engine failed with an error event and [DONE]
                log.warning("model %s: stream from replica %s carried an engine error: %s", model.name, replica,
                            broke)
            ok = broke is None
            routing.record_outcome(replica, not ok, None if ok else f"engine error mid-stream: {broke}")
        except _DrainTimeout:
            aborted = True
            drain = model.draining.timeout_s
            log.warning("model %s: stream from leaving replica %s still ran at the drain timeout (%gs); "
                        "aborted", model.name, replica, drain)
            _cancel(stream)
            err = error_body(f"the replica serving this stream of model {model.name!r} was stopped (scale-down, "
                             f"update or shutdown) and the stream ran past the drain timeout of {drain:g}s",
                             503, code="replica_drain_timeout")
            yield f"data: {json.dumps(err)}\n\n"
            finished = True
        except (_RequestDeadline, _StreamIdle) as exc:
            cut = True
            _cancel(stream)
            if isinstance(exc, _RequestDeadline):
                code, why = "request_timeout", f"ran past the request timeout of {limits.request_timeout_s:g}s"
            else:
                code, why = "stream_idle_timeout", f"sent nothing for {limits.stream_idle_timeout_s:g}s"
            log.warning("model %s: stream from replica %s %s; ended", model.name, replica, why)
            err = error_body(f"the stream from model {model.name!r} {why}", 504, code=code)
            yield f"data: {json.dumps(err)}\n\n"
            finished = True
        except Exception as exc:  # noqa: BLE001 - the stream already started: end it with a clear error event
            why = f"sent nothing for {timeout:g}s" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__
            log.warning("model %s: stream from replica %s broke mid-way: %s", model.name, replica, why)
            routing.record_outcome(replica, True, f"stream broke: {why}")
            _cancel(stream)
            err = error_body(f"the stream from model {model.name!r} broke: {why}", 503, code="stream_interrupted")
            ok = False
            yield f"data: {json.dumps(err)}\n\n"
            finished = True
        finally:
            end.close(finished, aborted, ok, cut)

    def _all_replicas_out(self, model: ModelConfig, routing: DeploymentRouting) -> JSONResponse:
        ops_metrics.rejection(model.name, "replicas_unavailable")
        wait = routing.unavailable_for_s() or 1.0
        return _error(503, f"every replica of model {model.name!r} is failing and temporarily out of service; "
                      "retry shortly", code="replicas_unavailable",
                      headers={"Retry-After": str(max(1, math.ceil(wait)))})

    @staticmethod
    def _scaled_to_zero(model: ModelConfig, routing: DeploymentRouting) -> bool:
        """The model may scale to zero and this gateway knows of no running replica."""
        return model.autoscaling is not None and model.autoscaling.min_replicas == 0 and not routing.replicas

    def _capacity(self, model: ModelConfig) -> int:
        """Requests the running replicas of the model's serving versions take at once: this gateway's
        share. Until a router has reported a version's running replicas (the first requests after a
        gateway starts), the configured count stands in for them."""
        replicas = 0
        for version in self.traffic.serving(model):
            routing = self._routing_state(model, version)
            if routing.synced:
                replicas += len(routing.replicas)
                if self._routable.get((model.name, version)) != len(routing.replicas):
                    self._routable[(model.name, version)] = len(routing.replicas)
                    replicas_routable(model.name, version, len(routing.replicas))
            else:
                replicas += model.autoscaling.min_replicas if model.autoscaling else model.replicas
        return replicas * model.max_ongoing_requests // self.config.gateway.replicas

    def _gate(self, model: ModelConfig) -> AdmissionGate:
        gate = self._gates.get(model.name)
        if gate is None:
            bound = math.ceil(model.admission.max_queued_requests / self.config.gateway.replicas)
            gate = self._gates[model.name] = AdmissionGate(bound)
        return gate

    def _drain_tracker(self, model: ModelConfig) -> DrainTracker:
        tracker = self._drains.get(model.name)
        if tracker is None:
            tracker = self._drains[model.name] = DrainTracker(model.name)
        return tracker

    def _routing_state(self, model: ModelConfig, version: str) -> DeploymentRouting:
        """The routing state this process shares with the router of one model version's deployment
        (breakers, prefix index)."""
        handle = self.servers[model.name][version]
        state = self._routing.get(handle.deployment_name)
        if state is None:
            state = self._routing[handle.deployment_name] = routing_state(
                deployment_key(handle.app_name, handle.deployment_name), model.name, model.routing_policy,
                model.routing, version=version)
        return state

    async def _read_json(self, request: Request, optional: bool = False) -> dict[str, Any]:
        """The request's JSON object. `optional`: an empty body is {} (admin actions with no settings)."""
        _require_json(request, optional)
        raw = await self._read_body(request)
        request.state.body_bytes = len(raw)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})",
                           code="invalid_encoding") from None
        if not text.strip():
            if optional:
                return {}
            raise ApiError(400, "request body is empty; send a JSON object", code="invalid_json")
        try:
            body = parsed_request.load_json(text)
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                                f"column {exc.colno}", code="invalid_json") from None
        except (ValueError, RecursionError) as exc:  # NaN/Infinity, a number past 4300 digits, deep nesting
            raise ApiError(400, f"request body is not acceptable JSON: {str(exc)[:120]}",
                           code="invalid_json") from None
        if _nesting_depth(body) > MAX_JSON_DEPTH:
            # Deeper structures serve no OpenAI request and would strain every layer that walks them.
            raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels",
                           code="invalid_json")
        if not isinstance(body, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}",
                           code="invalid_json")
        return body

    async def _read_body(self, request: Request) -> bytes:
        """The body, within max_body_bytes (413) and gateway.body_timeout_s (408). A body still arriving
        after FAST_BODY_S needs one of `max_body_reads` upload slots, or is refused at once (503): a request
        holds one of this replica's `max_ongoing_requests` slots while its body arrives, and without this
        bound a client trickling bodies over many connections would hold them all."""
        limit, timeout = self.config.gateway.max_body_bytes, self.config.gateway.body_timeout_s
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}",
                           code="request_too_large")
        chunks: list[bytes] = []
        reading = asyncio.ensure_future(_collect(request, limit, chunks))
        slot = False
        try:
            done, _ = await asyncio.wait({reading}, timeout=min(FAST_BODY_S, timeout))
            if not done:
                if self._upload_slots.locked():
                    raise ApiError(503, "too many slow request bodies are arriving at this gateway; send the "
                                   "body at once, or retry shortly", code="too_many_uploads",
                                   headers={"Retry-After": "1"})
                await self._upload_slots.acquire()
                slot = True
                done, _ = await asyncio.wait({reading}, timeout=max(0.0, timeout - FAST_BODY_S))
                if not done:
                    raise ApiError(408, f"the request body did not arrive within {timeout:g}s",
                                   code="body_timeout")
            reading.result()  # 413 past the limit
        finally:
            if not reading.done():
                reading.cancel()
            if slot:
                self._upload_slots.release()
        return b"".join(chunks)

    @staticmethod
    async def _parse(request: Request, endpoint: str, body: dict[str, Any]) -> parsed_request.ParsedRequest:
        """The request parsed by the engine's own model. Small bodies are parsed on the event loop; a
        large one (up to max_body_bytes) in a thread, so it never stalls the other requests."""
        if getattr(request.state, "body_bytes", 0) < _PARSE_INLINE_BYTES:
            return parsed_request.parse(endpoint, body)
        return await asyncio.to_thread(parsed_request.parse, endpoint, body)

    def _resolve_model(self, name: str, endpoint: str, caller: Caller) -> ModelConfig:
        model = self.config.find_model(name)
        if model is None:
            visible = [m.name for m in self.config.models if caller.may_use(m.name)]
            raise ApiError(404, f"model {name!r} does not exist; models this key may use: "
                           f"{', '.join(visible) or 'none'} (GET /v1/models)", param="model",
                           code="model_not_found")
        if _ENDPOINT_TASK[endpoint] != model.task:
            what = "an embedding model; use /v1/embeddings" if model.task == "embed" else \
                "a generative model; use /v1/chat/completions or /v1/completions"
            raise ApiError(400, f"model {model.name!r} is {what}", param="model",
                           code="model_not_supported")
        return model
