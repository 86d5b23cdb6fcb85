"""The OpenAI API and the probes: routes that check the caller and delegate.

`/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/responses` (OpenAI's Responses API)
and `/v1/messages` (Anthropic's Messages API), one route per endpoint descriptor (shunter.endpoints), go
through the one forward pipeline (shunter.deployments.gateway.forward); `/v1/models` lists what the
caller's key may use and what each model supports; `/health` says the process lives and `/ready` that every
model has a replica that answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from shunter.config import ModelConfig
from shunter.deployments.gateway.api_app import KEYED, RETRY_AFTER_S, error_response
from shunter.deployments.gateway.lora import Adapter
from shunter.deployments.gateway.openapi import request_body
from shunter.deployments.gateway.parts import GatewayParts, Parts
from shunter.deployments.gateway.rate_headers import remember
from shunter.endpoints import ENDPOINTS, Endpoint
from shunter.endpoints import serving as serving_paths

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    """The gateway process is alive. Says nothing about the engines: see /ready."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request, gw: Parts) -> JSONResponse:
    """200 when every model has a replica that has answered a real request; 503 otherwise. The details
    (per model: versions, replica, process, cores, placement, reasons) only for an admin key (anyone when
    no key is configured); a probe without one gets `{"ready": ...}` alone."""
    timeout = gw.config.gateway.ready_timeout_s
    gw.traffic.ensure_started()

    async def probe_version(model: ModelConfig, version: str) -> tuple[dict[str, Any] | None, str | None]:
        if gw.state.scaled_to_zero(model, gw.state.routing(model, version)):
            # Probing would start a replica; a model allowed to scale to zero starts on demand.
            return {"replicas": 0, "starts_on_demand": True}, None
        try:
            return await asyncio.wait_for(gw.servers[model.name][version].ready.remote(), timeout), None
        except TimeoutError:
            return None, f"no replica answered within {timeout}s"
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready", with the reason shown
            return None, f"{type(exc).__name__}: {exc}"[:300]

    async def probe(model: ModelConfig) -> tuple[str, dict[str, Any] | None, str | None]:
        """A model is ready when every version that takes traffic has a replica that answers."""
        versions = gw.traffic.serving(model)
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

    results = await asyncio.gather(*(probe(m) for m in gw.config.models))
    models = {name: ({"ready": True, **info} if info else {"ready": False, "reason": why})
              for name, info, why in results}
    ok = all(m["ready"] for m in models.values())
    headers = None if ok else {"Retry-After": RETRY_AFTER_S}
    answer = {"ready": ok, "models": models} if gw.access.sees_details(request.headers) else {"ready": ok}
    return JSONResponse(answer, status_code=200 if ok else 503, headers=headers)


@router.get("/v1/models", openapi_extra=KEYED)
async def list_models(request: Request, gw: Parts) -> dict[str, Any]:
    """The models the caller's key may use."""
    caller = gw.access.client(request.headers)
    remember(request, gw.access, caller)
    cards = [_model_card(gw, m) for m in gw.config.models if caller.may_use(m.name)]
    cards += [_adapter_card(gw, a) for m in gw.config.models for a in gw.adapters.of(m)
              if caller.may_use(a.name, m.name)]
    if gw.tiering and any(caller.may_use(t.model) for t in gw.tiering.router.tiers):
        cards.append(_tier_card(gw))
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model_id:path}", openapi_extra=KEYED)
async def get_model(model_id: str, request: Request, gw: Parts) -> Response:
    caller = gw.access.client(request.headers)
    remember(request, gw.access, caller)
    if gw.tiering and model_id == gw.tiering.name:
        return JSONResponse(_tier_card(gw))
    model = gw.config.find_model(model_id)
    if model is None:
        adapter = gw.adapters.find(model_id)
        if adapter is None:
            return error_response(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")
        gw.access.check_model(caller, adapter.name, base=adapter.base.name)
        return JSONResponse(_adapter_card(gw, adapter))
    gw.access.check_model(caller, model.name)
    return JSONResponse(_model_card(gw, model))


def _api_route(endpoint: Endpoint) -> Callable[..., Awaitable[Response]]:
    async def route(request: Request, gw: Parts) -> Response:
        return await gw.forwarder.forward(request, endpoint)

    route.__name__ = route.__qualname__ = endpoint.name
    return route


# One route per API, from its descriptor: adding an endpoint is one descriptor in shunter.endpoints.
for _endpoint in ENDPOINTS.values():
    router.add_api_route(_endpoint.path, _api_route(_endpoint), methods=["POST"], summary=_endpoint.summary,
                         openapi_extra=request_body(_endpoint))


def _tier_card(gw: GatewayParts) -> dict[str, Any]:
    assert gw.tiering is not None
    return {"id": gw.tiering.name, "object": "model", "created": gw.created, "owned_by": "shunter",
            "aliases": [], "task": "generate", "tiers": [t.name for t in gw.tiering.router.tiers]}


def _model_card(gw: GatewayParts, model: ModelConfig) -> dict[str, Any]:
    card = {"id": model.name, "object": "model", "created": gw.created, "owned_by": "shunter",
            "aliases": model.aliases, "task": model.task, "capabilities": capabilities(model)}
    if model.versioned:
        card["versions"] = [{"name": v, "weight": w} for v, w in gw.traffic.view(model).weights]
    return card


def _adapter_card(gw: GatewayParts, adapter: Adapter) -> dict[str, Any]:
    """A LoRA adapter, listed as a model whose `parent` is its base (as vLLM's own server lists them)."""
    model = adapter.base
    return {"id": adapter.name, "object": "model", "created": gw.created, "owned_by": "shunter",
            "parent": model.name, "aliases": [f"{model.name}:{adapter.name}"], "task": model.task,
            "capabilities": capabilities(model)}


def capabilities(model: ModelConfig) -> dict[str, Any]:
    """What a model serves, and where it does not, the config field that would enable it."""
    if model.task == "embed":
        return {"endpoints": serving_paths(model.task)}
    serving = model.serving
    choices = ["none"]
    if serving.tool_call_parser is not None:
        choices += (["auto"] if serving.auto_tool_choice else []) + ["required", "function"]
    return {
        "endpoints": serving_paths(model.task),
        "tools": {"tool_call_parser": serving.tool_call_parser, "tool_choice": choices}
        if serving.tool_call_parser else {"enabled_by": "serving.tool_call_parser"},
        "reasoning": {"reasoning_parser": serving.reasoning_parser}
        if serving.reasoning_parser else {"enabled_by": "serving.reasoning_parser"},
        "chat_template": "serving.chat_template" if serving.chat_template else "the model's own",
        "stateful_responses": False,
    }
