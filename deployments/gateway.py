"""Gateway: the HTTP ingress. OpenAI endpoints, input checks, model resolution, streaming, errors.

What the gateway decides itself, before any engine sees the request: body size (413), encoding and
JSON syntax (400), the `model` field (400 missing, 404 unknown), and whether the model serves this
endpoint (400). Everything about the request's content (messages, sampling parameters, context
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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from routing.failover import ReplicaFailure, with_failover
from routing.state import DeploymentRouting, deployment_key, routing_state
from shunter.config import ModelConfig, ShunterConfig
from shunter.errors import error_body
from shunter.replica_protocol import Accepted, ReplicaRequest

log = logging.getLogger("ray.serve")

# Which model task serves which endpoint.
_ENDPOINT_TASK = {"chat": "generate", "completion": "generate", "embedding": "embed"}
_RETRY_AFTER_S = "5"
MAX_JSON_DEPTH = 64
REPLICA_HEADER = "x-shunter-replica"  # which replica served the request: for operators and tests

app = FastAPI(title="Shunter", description="OpenAI-compatible multi-model gateway", docs_url=None, redoc_url=None)


def _error(status: int, message: str, param: str | None = None, code: str | int | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param=param, code=code), status_code=status, headers=headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _error(400, "invalid request")


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error in gateway for %s %s", request.method, request.url.path)
    return _error(500, "internal error in the gateway; see the server log")


def _nesting_depth(value: Any) -> int:
    """Depth of nested lists/dicts, computed without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


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


class _QueueTimeout(Exception):
    """No replica took the request within gateway.queue_timeout_s."""


class _AllReplicasOut(Exception):
    """Every replica's breaker is open: nothing to send to, or to retry on."""


class _NoReplica(Exception):
    """The request failed before any replica took it (none running, deployment failed)."""


class BadRequest(Exception):
    """A client error found while reading the request; carries its ready response."""

    def __init__(self, response: JSONResponse):
        self.response = response


@serve.deployment
@serve.ingress(app)
class Gateway:
    def __init__(self, config: dict[str, Any], model_servers: dict[str, DeploymentHandle]):
        self.config = ShunterConfig.model_validate(config)
        self.servers = model_servers
        self.created = int(time.time())
        self._routing: dict[str, DeploymentRouting] = {}

    # ---- probes ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        """The gateway process is alive. Says nothing about the engines: see /ready."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self) -> JSONResponse:
        """200 when every model has a replica that has answered a real request; 503 otherwise."""
        timeout = self.config.gateway.ready_timeout_s

        async def probe(model: ModelConfig) -> tuple[str, dict[str, Any] | None, str | None]:
            try:
                info = await asyncio.wait_for(self.servers[model.name].ready.remote(), timeout)
                return model.name, info, None
            except asyncio.TimeoutError:
                return model.name, None, f"no replica answered within {timeout}s"
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready", with the reason shown
                return model.name, None, f"{type(exc).__name__}: {exc}"[:300]

        results = await asyncio.gather(*(probe(m) for m in self.config.models))
        models = {name: ({"ready": True, **info} if info else {"ready": False, "reason": why})
                  for name, info, why in results}
        ok = all(m["ready"] for m in models.values())
        headers = None if ok else {"Retry-After": _RETRY_AFTER_S}
        return JSONResponse({"ready": ok, "models": models}, status_code=200 if ok else 503, headers=headers)

    # ---- OpenAI API -----------------------------------------------------------------------------

    @app.get("/v1/models")
    async def list_models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": m.name, "object": "model", "created": self.created, "owned_by": "shunter",
                 "aliases": m.aliases, "task": m.task}
                for m in self.config.models
            ],
        }

    @app.get("/v1/models/{model_id:path}")
    async def get_model(self, model_id: str) -> Response:
        model = self.config.find_model(model_id)
        if model is None:
            return _error(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")
        return JSONResponse({"id": model.name, "object": "model", "created": self.created,
                             "owned_by": "shunter", "aliases": model.aliases, "task": model.task})

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward(request, "chat")

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward(request, "completion")

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        return await self._forward(request, "embedding")

    # ---- forwarding -----------------------------------------------------------------------------

    async def _forward(self, request: Request, endpoint: str) -> Response:
        try:
            body = await self._read_json(request)
            model = self._resolve_model(body, endpoint)
        except BadRequest as bad:
            return bad.response
        body["model"] = model.name  # the engine knows the canonical name only
        routing = self._routing_state(model)
        if routing.unavailable_for_s() is not None:
            # Every replica's breaker is open: say so at once rather than queue behind failing replicas.
            return self._all_replicas_out(model, routing)
        request_id = uuid.uuid4().hex

        def failed(failure: ReplicaFailure) -> None:
            log.warning("model %s request %s: replica %s failed before the first byte: %s", model.name,
                        request_id, failure.replica, failure.why)
            routing.record_outcome(failure.replica, True, failure.why)

        async def attempt(avoid: tuple[str, ...]) -> _Started:
            if avoid and routing.unavailable_for_s() is not None:
                raise _AllReplicasOut()  # the failure just recorded opened the last breaker
            try:
                return await self._attempt(model, ReplicaRequest(request_id=request_id, avoid=avoid,
                                                                 endpoint=endpoint, body=body))
            finally:
                routing.first_byte(request_id)  # answered or failed: its prefill no longer queues anywhere

        try:
            started = await with_failover(attempt, model.routing.retry_once, failed)
        except _QueueTimeout:
            timeout = self.config.gateway.queue_timeout_s
            log.warning("model %s: no replica accepted a request within %ss", model.name, timeout)
            return _error(503, f"no replica of model {model.name!r} could take the request within {timeout:g}s"
                          "; retry shortly", code="queue_timeout", headers={"Retry-After": _RETRY_AFTER_S})
        except _AllReplicasOut:
            return self._all_replicas_out(model, routing)
        except (ReplicaFailure, _NoReplica) as exc:
            if isinstance(exc, _NoReplica):
                log.warning("model %s: request failed before any replica took it: %r", model.name, exc.__cause__)
            return _error(503, f"model {model.name!r} has no replica able to serve right now; retry shortly",
                          code="model_unavailable", headers={"Retry-After": _RETRY_AFTER_S})
        headers = {REPLICA_HEADER: started.replica}
        if not started.head["stream"]:
            routing.record_outcome(started.replica, False)
            return JSONResponse(started.head["body"], status_code=started.head["status"], headers=headers)
        return StreamingResponse(self._relay(started, model, routing), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    async def _attempt(self, model: ModelConfig, request: ReplicaRequest) -> _Started:
        """Send once and wait for the replica's first answer: the reply head, and for a stream its first
        chunk too, so a replica that fails before any byte reaches the client can be failed over."""
        stream = None
        try:
            stream = self.servers[model.name].options(stream=True).handle.remote(request)
            # A replica answers Accepted as soon as it takes the request; waiting for that is bounded, so
            # a model whose replicas cannot take work (none started, all full) is a 503, never a hang.
            try:
                accepted = await asyncio.wait_for(stream.__anext__(), self.config.gateway.queue_timeout_s)
            except asyncio.TimeoutError:
                raise _QueueTimeout() from None
            except Exception as exc:  # noqa: BLE001 - no replica, replica gone before taking it
                raise _NoReplica() from exc
            if not isinstance(accepted, Accepted):
                raise _NoReplica() from RuntimeError(f"replica protocol: expected Accepted, got {accepted!r}")
            replica, timeout = accepted.replica_id, model.routing.replica_timeout_s
            try:
                head = await asyncio.wait_for(stream.__anext__(), timeout)
                first = None
                if head["stream"]:
                    try:
                        first = await asyncio.wait_for(stream.__anext__(), timeout)
                    except StopAsyncIteration:
                        first = None
            except asyncio.TimeoutError:
                raise ReplicaFailure(replica, f"sent nothing for {timeout:g}s (hung?)") from None
            except Exception as exc:  # noqa: BLE001 - replica died, engine raised: the replica's fault
                raise ReplicaFailure(replica, f"{type(exc).__name__}: {exc}"[:300]) from None
            if head["status"] >= 500:
                message = ((head.get("body") or {}).get("error") or {}).get("message", "")
                raise ReplicaFailure(replica, f"engine answered {head['status']}: {message}"[:300])
            return _Started(replica, head, stream, first)
        except BaseException:
            _cancel(stream)
            raise

    async def _relay(self, started: _Started, model: ModelConfig, routing: DeploymentRouting) -> AsyncIterator[str]:
        """SSE chunks from the replica to the client. A client that goes away cancels the replica's work;
        a replica that breaks or goes silent mid-stream ends the stream with an explicit error event."""
        finished = False
        stream, replica, timeout = started.stream, started.replica, model.routing.replica_timeout_s
        try:
            if started.first_chunk is not None:
                yield started.first_chunk
            while True:
                try:
                    chunk = await asyncio.wait_for(stream.__anext__(), timeout)
                except StopAsyncIteration:
                    break
                yield chunk
            finished = True
            routing.record_outcome(replica, False)
        except Exception as exc:  # noqa: BLE001 - the stream already started: end it with a clear error event
            why = f"sent nothing for {timeout:g}s" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__
            log.warning("model %s: stream from replica %s broke mid-way: %s", model.name, replica, why)
            routing.record_outcome(replica, True, f"stream broke: {why}")
            _cancel(stream)
            err = error_body(f"the stream from model {model.name!r} broke: {why}", 503, code="stream_interrupted")
            yield f"data: {json.dumps(err)}\n\n"
            finished = True
        finally:
            if not finished:  # client disconnected or we were cancelled: abort the engine request
                _cancel(stream)

    def _all_replicas_out(self, model: ModelConfig, routing: DeploymentRouting) -> JSONResponse:
        wait = routing.unavailable_for_s() or 1.0
        return _error(503, f"every replica of model {model.name!r} is failing and temporarily out of service; "
                      "retry shortly", code="replicas_unavailable",
                      headers={"Retry-After": str(max(1, math.ceil(wait)))})

    def _routing_state(self, model: ModelConfig) -> DeploymentRouting:
        """The routing state this process shares with the model's router (breakers, prefix index)."""
        state = self._routing.get(model.name)
        if state is None:
            handle = self.servers[model.name]
            state = self._routing[model.name] = routing_state(
                deployment_key(handle.app_name, handle.deployment_name), model.name, model.routing_policy,
                model.routing)
        return state

    async def _read_json(self, request: Request) -> dict[str, Any]:
        limit = self.config.gateway.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(_error(413, f"request body is {declared} bytes; the limit is {limit}",
                                    code="request_too_large"))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(_error(413, f"request body exceeds the limit of {limit} bytes",
                                        code="request_too_large"))
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequest(_error(400, f"request body is not valid UTF-8 (byte {exc.start})",
                                    code="invalid_encoding")) from None
        if not text.strip():
            raise BadRequest(_error(400, "request body is empty; send a JSON object", code="invalid_json"))
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadRequest(_error(400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                                         f"column {exc.colno}", code="invalid_json")) from None
        except (ValueError, RecursionError) as exc:  # a number past 4300 digits, nesting past the parser's depth
            raise BadRequest(_error(400, f"request body is not acceptable JSON: {str(exc)[:120]}",
                                    code="invalid_json")) from None
        if _nesting_depth(body) > MAX_JSON_DEPTH:
            # Deeper structures serve no OpenAI request and would strain every layer that walks them.
            raise BadRequest(_error(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels",
                                    code="invalid_json"))
        if not isinstance(body, dict):
            raise BadRequest(_error(400, f"request body must be a JSON object, got {type(body).__name__}",
                                    code="invalid_json"))
        return body

    def _resolve_model(self, body: dict[str, Any], endpoint: str) -> ModelConfig:
        name = body.get("model")
        if name is None:
            raise BadRequest(_error(400, "missing required field 'model'", param="model", code="missing_field"))
        if not isinstance(name, str):
            raise BadRequest(_error(400, f"'model' must be a string, got {type(name).__name__}", param="model",
                                    code="invalid_type"))
        model = self.config.find_model(name)
        if model is None:
            known = ", ".join(m.name for m in self.config.models)
            raise BadRequest(_error(404, f"model {name!r} does not exist; served models: {known}", param="model",
                                    code="model_not_found"))
        if _ENDPOINT_TASK[endpoint] != model.task:
            what = "an embedding model; use /v1/embeddings" if model.task == "embed" else \
                "a generative model; use /v1/chat/completions or /v1/completions"
            raise BadRequest(_error(400, f"model {model.name!r} is {what}", param="model",
                                    code="model_not_supported"))
        return model
