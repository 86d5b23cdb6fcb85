"""The admin API's LoRA adapter routes: list, add and remove a model's adapters while it serves, and roll
one out to new files behind the model's rollout gates (`shunter.deployments.gateway.lora` owns the table).

Like every admin route, each needs an admin key when keys are configured and reads its body through the
gateway's JSON door. Changes go to the control actor (`shunter.ops.control`), which keeps them in the
cluster's state for every gateway.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from shunter.config import ModelConfig, RolloutConfig, format_config_error
from shunter.deployments.gateway.admin_routes import admin_model, control_call
from shunter.deployments.gateway.admin_schema import AdapterBody, AdapterRolloutBody, parse_body
from shunter.deployments.gateway.api_app import error_response
from shunter.deployments.gateway.lora import Adapter
from shunter.deployments.gateway.openapi import request_body
from shunter.deployments.gateway.parts import GatewayParts, Parts
from shunter.errors import ApiError
from shunter.lora_sources import AdapterSourceError, is_remote, remote_adapter_config

log = logging.getLogger("ray.serve")

router = APIRouter()
# Reading a remote adapter's adapter_config.json at the door: a store slower than this is reported, not
# waited for (the admin call would otherwise hang on a blackholed endpoint).
REMOTE_CHECK_TIMEOUT_S = 20.0


@router.get("/admin/models/{model_id:path}/adapters")
async def list_adapters(model_id: str, request: Request, gw: Parts) -> Response:
    """The model's adapters (from the config, its adapter_dirs, or this API) and, as this gateway's routers
    believe, the replicas whose engines hold each."""
    gw.access.admin(request.headers)
    model = admin_model(gw, model_id)
    gw.traffic.ensure_started()
    await gw.traffic.refresh_now()
    held = {version: gw.state.routing(model, version) for version in model.version_names()}
    rows = [{**a.card(), "held_by": sorted(r for routing in held.values() for r in routing.replicas
                                           if routing.holds_adapter(r, a.name))} for a in gw.adapters.of(model)]
    return JSONResponse({"model": model.name, "lora": model.lora, "adapters": rows})


@router.post("/admin/models/{model_id:path}/adapters", openapi_extra=request_body(AdapterBody))
async def add_adapter(model_id: str, request: Request, gw: Parts) -> Response:
    """Body: {"name": ..., "source": the adapter's directory or object-store folder}. Serves a new adapter of the model, or new
    files for one it serves (201 / 200), on every gateway within a second; each replica loads it when
    first asked. Its rank must fit the model's engine.max_lora_rank."""
    gw.access.admin(request.headers)
    body = parse_body(AdapterBody, await gw.body.read_json(request))
    model = admin_model(gw, model_id)
    gw.adapters.check_addition(model, body.name)
    current = gw.adapters.find(f"{model.name}:{body.name}")
    if current is not None and gw.adapters.rolling_out(current):
        raise ApiError(409, f"adapter {body.name!r} has a rollout under way; wait for it or roll it back first",
                       param="name", code="rollout_refused")
    rank = await _rank_of(body)
    too_small = [e.max_lora_rank for e in model.engines() if rank is not None and rank > e.max_lora_rank]
    if too_small:
        raise ApiError(400, f"adapter {body.name!r} has rank {rank}, above the model's engine.max_lora_rank "
                       f"{min(too_small)}", param="source", code="adapter_rank_too_high")
    replaced = any(a.name == body.name for a in gw.adapters.of(model))
    refused = await _set_adapter(gw, model, body.name, body.source)
    if refused is not None:
        return refused
    adapter = gw.adapters.find(body.name)
    assert adapter is not None
    return JSONResponse(adapter.card(), status_code=200 if replaced else 201)


@router.delete("/admin/models/{model_id:path}/adapters/{name}")
async def remove_adapter(model_id: str, name: str, request: Request, gw: Parts) -> Response:
    """Stop serving an adapter (one from the config too, until the config's adapters change). Requests
    for it get 404 on every gateway within a second; a request already running finishes."""
    gw.access.admin(request.headers)
    model = admin_model(gw, model_id)
    adapter = _admin_adapter(gw, model, name)
    if gw.adapters.rolling_out(adapter):
        raise ApiError(409, f"adapter {name!r} has a rollout under way; roll it back first", param="name",
                       code="rollout_refused")
    refused = await _set_adapter(gw, model, name, None)
    if refused is not None:
        return refused
    return JSONResponse({"model": model.name, "name": name, "removed": True})


@router.post("/admin/models/{model_id:path}/adapters/{name}/rollout", openapi_extra=request_body(AdapterRolloutBody))
async def start_adapter_rollout(model_id: str, name: str, request: Request, gw: Parts) -> Response:
    """Body: {"source": the new version's directory, and any of the model's `rollout` settings}. Moves the
    adapter's traffic to its new files through the model's rollout steps and gates, as a model's rollout
    does (202); promoted, the adapter serves from the new directory; rolled back, from the old."""
    from shunter.config.adapters import AdapterConfig

    gw.access.admin(request.headers)
    body = parse_body(AdapterRolloutBody, await gw.body.read_json(request))
    model = admin_model(gw, model_id)
    adapter = _admin_adapter(gw, model, name)
    try:  # the new files are checked as the config's are
        new = AdapterConfig.model_validate({"name": adapter.name, "source": body.source})
    except ValidationError as exc:
        return error_response(400, format_config_error(exc, AdapterConfig).replace("\n", " "), param="source",
                              code="invalid_adapter")
    rank = await _rank_of(new)
    if rank is not None and any(rank > e.max_lora_rank for e in model.engines()):
        return error_response(400, f"the new version has rank {rank}, above the model's engine.max_lora_rank",
                              param="source", code="adapter_rank_too_high")
    if new.source == adapter.source:
        return error_response(409, f"adapter {name!r} already serves from {new.source}", param="source",
                              code="rollout_refused")
    overrides = (body.model_extra or {})
    try:  # the same checks as the config file's `rollout:` section
        merged = RolloutConfig.model_validate({**model.rollout.model_dump(mode="json"), **overrides})
    except ValidationError as exc:
        return error_response(400, format_config_error(exc, RolloutConfig).replace("\n", " "), code="invalid_rollout")
    context = gw.adapters.rollout_context(adapter, new.source)
    call = gw.traffic.actor().start_rollout.remote(context, context["versions"][1], merged.model_dump(mode="json"))
    return await _adapter_rollout_call(gw, adapter, call, 202)


@router.get("/admin/models/{model_id:path}/adapters/{name}/rollout")
async def adapter_rollout_status(model_id: str, name: str, request: Request, gw: Parts) -> Response:
    """The adapter's versions (by directory), their live weights, and its latest rollout."""
    gw.access.admin(request.headers)
    model = admin_model(gw, model_id)
    await gw.traffic.refresh_now()  # before the lookup: a rollout just promoted has moved the adapter's files
    return JSONResponse(_adapter_rollout_status(gw, _admin_adapter(gw, model, name)))


@router.post("/admin/models/{model_id:path}/adapters/{name}/rollout/{action}")
async def adapter_rollout_action(model_id: str, name: str, action: str, request: Request, gw: Parts) -> Response:
    """`pause`, `resume` or `rollback` the adapter's rollout."""
    gw.access.admin(request.headers)
    await gw.body.read_json(request, optional=True)  # JSON or nothing: never a cross-site form
    adapter = _admin_adapter(gw, admin_model(gw, model_id), name)
    if action not in ("pause", "resume", "rollback"):
        raise ApiError(404, f"no rollout action {action!r}; use pause, resume or rollback", code="not_found")
    return await _adapter_rollout_call(gw, adapter, getattr(gw.traffic.actor(), action).remote(adapter.rollout_key))


async def _adapter_rollout_call(gw: GatewayParts, adapter: Adapter, call: Any, status: int = 200) -> Response:
    refused = await control_call(call, f"adapter {adapter.rollout_key}: rollout call", param="name")
    if refused is not None:
        return refused
    await gw.traffic.refresh_now()
    now = next((a for a in gw.adapters.of(adapter.base) if a.name == adapter.name), adapter)  # promoted: new files
    return JSONResponse(_adapter_rollout_status(gw, now), status_code=status)


def _adapter_rollout_status(gw: GatewayParts, adapter: Adapter) -> dict[str, Any]:
    entry = (gw.traffic.state.get("rollouts") or {}).get(adapter.rollout_key)
    current = entry is not None and entry["context"].get("fingerprint") == adapter.base.adapters_fingerprint()
    live = ((gw.traffic.state.get("models") or {}).get(adapter.rollout_key) or {}) if current else {}
    sources = entry["context"]["sources"] if current else {}
    return {"model": adapter.base.name, "adapter": adapter.name, "source": adapter.source,
            "versions": [{"version": v, "source": sources.get(v), "weight": w} for v, w in live.get("weights", [])],
            "rollout": entry["rollout"] if current else None}


def _admin_adapter(gw: GatewayParts, model: ModelConfig, name: str) -> Adapter:
    adapter = next((a for a in gw.adapters.of(model) if a.name == name), None)
    if adapter is None:
        raise ApiError(404, f"model {model.name!r} has no adapter {name!r}", param="name", code="adapter_not_found")
    return adapter


async def _rank_of(adapter: Any) -> int | None:
    """The adapter's LoRA rank. An adapter in an object store has its adapter_config.json read from the
    store now, with this gateway's credentials: a missing or unreadable source is a 400 to the operator
    here rather than a 422 to the first client that asks for it."""
    if not is_remote(adapter.source):
        return adapter.rank()
    try:
        config = await asyncio.wait_for(asyncio.to_thread(remote_adapter_config, adapter.source),
                                        REMOTE_CHECK_TIMEOUT_S)
    except AdapterSourceError as exc:
        raise ApiError(400, str(exc), param="source", code="adapter_source_unreadable") from None
    except TimeoutError:
        raise ApiError(400, f"{adapter.source} did not answer within {REMOTE_CHECK_TIMEOUT_S:.0f}s", param="source",
                       code="adapter_source_unreadable") from None
    rank = config.get("r")
    return rank if isinstance(rank, int) else None


async def _set_adapter(gw: GatewayParts, model: ModelConfig, name: str, source: str | None) -> Response | None:
    """The change saved in the control state (None), or why not."""
    call = gw.traffic.actor().set_adapter.remote(model.name, model.adapters_fingerprint(), name, source)
    refused = await control_call(call, f"model {model.name}: adapter {name} change", param="name")
    if refused is None:
        await gw.traffic.refresh_now()  # this gateway at once; the others at their next read of the state
    return refused
