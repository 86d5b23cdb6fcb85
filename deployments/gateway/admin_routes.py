"""The admin API: rollouts and live weights, tier routing's state, an operator's replica drains, and usage
and cost per tenant from the usage ledger (LoRA adapters: `lora_routes`; each key's own usage, OpenAI's
Usage API: `usage_routes`).

Every route needs an admin key when keys are configured (403 otherwise), and reads its body, when it
has one, through the same JSON door as the OpenAI routes (a cross-site form can never reach it). Rollout
actions go to the control actor (shunter.ops.control), which owns rollouts and live weights for every
gateway; replica drains go through shunter.deployments.gateway.replica_admin.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from shunter.config import ModelConfig, RolloutConfig, format_config_error
from shunter.deployments.gateway.admin_schema import DrainBody, RolloutStartBody, WeightsBody, parse_body
from shunter.deployments.gateway.api_app import RETRY_AFTER_S, error_response
from shunter.deployments.gateway.openapi import request_body
from shunter.deployments.gateway.parts import GatewayParts, Parts
from shunter.deployments.gateway.usage_params import parse_usage_query
from shunter.errors import ApiError

log = logging.getLogger("ray.serve")

router = APIRouter()


# ---- rollouts and live weights -------------------------------------------------------------------------

@router.get("/admin/rollouts")
async def list_rollouts(request: Request, gw: Parts) -> dict[str, Any]:
    """Every versioned model: its live weights and its latest rollout."""
    gw.access.admin(request.headers)
    await gw.traffic.refresh_now()
    return {"models": [_rollout_status(gw, m) for m in gw.config.models if m.versioned]}


@router.post("/admin/rollouts/{model_id:path}/pause")
async def pause_rollout(model_id: str, request: Request, gw: Parts) -> Response:
    gw.access.admin(request.headers)
    await gw.body.read_json(request, optional=True)  # JSON or nothing: never a cross-site form
    return await _control_call(gw, model_id, "pause")


@router.post("/admin/rollouts/{model_id:path}/resume")
async def resume_rollout(model_id: str, request: Request, gw: Parts) -> Response:
    gw.access.admin(request.headers)
    await gw.body.read_json(request, optional=True)
    return await _control_call(gw, model_id, "resume")


@router.post("/admin/rollouts/{model_id:path}/rollback")
async def rollback_rollout(model_id: str, request: Request, gw: Parts) -> Response:
    gw.access.admin(request.headers)
    await gw.body.read_json(request, optional=True)
    return await _control_call(gw, model_id, "rollback")


@router.get("/admin/rollouts/{model_id:path}")
async def get_rollout(model_id: str, request: Request, gw: Parts) -> Response:
    gw.access.admin(request.headers)
    model = gw.config.find_model(model_id)
    if model is None:
        return error_response(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")
    await gw.traffic.refresh_now()
    return JSONResponse(_rollout_status(gw, model))


@router.post("/admin/rollouts/{model_id:path}", openapi_extra=request_body(RolloutStartBody))
async def start_rollout(model_id: str, request: Request, gw: Parts) -> Response:
    """Body: {"to": VERSION} plus any of the model's `rollout` settings to use for this rollout only
    (steps, hold_s, max_hold_s, ready_timeout_s, gates)."""
    gw.access.admin(request.headers)
    body = parse_body(RolloutStartBody, await gw.body.read_json(request))
    return await _control_call(gw, model_id, "start", to=body.to, overrides=body.model_extra or {})


@router.get("/admin/tiers")
async def tier_status(request: Request, gw: Parts) -> Response:
    """Tier routing: the tiers, the classes the monitor promoted, its windows."""
    gw.access.admin(request.headers)
    if gw.tiering is None:
        return error_response(404, "tier routing is off (no `tiers:` in the config)", code="tiers_off")
    return JSONResponse(gw.tiering.status())


@router.put("/admin/models/{model_id:path}/weights", openapi_extra=request_body(WeightsBody))
async def set_weights(model_id: str, request: Request, gw: Parts) -> Response:
    """Body: {"weights": {VERSION: WEIGHT, ...}}. Versions given a weight above 0 run; the others are
    retired. Refused while a rollout of the model is in progress."""
    gw.access.admin(request.headers)
    body = parse_body(WeightsBody, await gw.body.read_json(request))
    return await _control_call(gw, model_id, "weights", weights=list(body.weights.items()))


# ---- usage and cost per tenant (the usage ledger) ------------------------------------------------------

@router.get("/admin/usage")
async def usage(request: Request, gw: Parts, key: str | None = None, model: str | None = None,
                since: str | None = None, until: str | None = None, group_by: str | None = None) -> Response:
    """Tokens and cost from the usage ledger, summed per group: `key` (a key's configured name) and `model`
    filter; `since` and `until` (unix seconds or ISO 8601; the window is [since, until)); `group_by`: a comma
    list of key, model, adapter, priority_class, endpoint (default key,model; empty: one row). This gateway
    sends its own buffered records first; other gateways' arrive within usage.flush_interval_s."""
    gw.access.admin(request.headers)
    query = parse_usage_query(key, model, since, until, group_by, gw.config)
    if gw.usage is None:
        return error_response(503, "the usage ledger is off (usage.enabled: false in the config)",
                              code="usage_ledger_unavailable")
    await gw.usage.flush()
    try:
        rows = await gw.usage.query(**query)
    except Exception as exc:  # noqa: BLE001 - the ledger restarting or unreachable
        log.warning("usage ledger query failed: %r", exc)
        return error_response(503, f"the usage ledger did not answer ({type(exc).__name__}); retry shortly",
                              code="usage_ledger_unavailable", headers={"Retry-After": RETRY_AFTER_S})
    return JSONResponse({"object": "list", "data": rows, "since": query["since"], "until": query["until"],
                         "group_by": list(query["group_by"])})


# ---- replicas (drain one: no new requests, then Ray Serve replaces it once idle) ---------------------------

@router.get("/admin/models/{model_id:path}/replicas")
async def list_replicas(model_id: str, request: Request, gw: Parts) -> Response:
    """The model's running replicas as this gateway routes to them: version, cordoned, standby (a warm
    replica routed nothing while a serving one can take it), requests it has in flight there, breaker state."""
    gw.access.admin(request.headers)
    model = admin_model(gw, model_id)
    gw.traffic.ensure_started()
    await gw.traffic.refresh_now()
    return JSONResponse({"model": model.name, "replicas": await gw.replicas.replicas(model)})


@router.post("/admin/models/{model_id:path}/replicas/{replica_id}/drain", openapi_extra=request_body(DrainBody))
async def drain_replica(model_id: str, replica_id: str, request: Request,
                        gw: Parts) -> Response:
    """Body (optional): {"replace": true, "timeout_s": the model's draining.timeout_s, "force": false}.
    Cordons the replica on every gateway; with `replace`, Ray Serve replaces it once it holds no request
    (at the latest after timeout_s). Refused for the last routable replica without `force`, and while the
    model has a rollout in progress."""
    gw.access.admin(request.headers)
    body = parse_body(DrainBody, await gw.body.read_json(request, optional=True))
    model = admin_model(gw, model_id)
    within_s = body.timeout_s if body.timeout_s is not None else model.draining.timeout_s
    gw.traffic.ensure_started()
    answer = await gw.replicas.drain(model, replica_id, body.replace, float(within_s), body.force)
    return JSONResponse(answer, status_code=202)


@router.delete("/admin/models/{model_id:path}/replicas/{replica_id}/drain")
async def release_replica(model_id: str, replica_id: str, request: Request,
                          gw: Parts) -> Response:
    """Undo a drain: the replica takes new requests again and, if it was to retire, stays."""
    gw.access.admin(request.headers)
    model = admin_model(gw, model_id)
    return JSONResponse(await gw.replicas.release(model, replica_id))


def admin_model(gw: GatewayParts, model_id: str) -> ModelConfig:
    model = gw.config.find_model(model_id)
    if model is None:
        raise ApiError(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")
    return model


async def _control_call(gw: GatewayParts, model_id: str, action: str, **kwargs: Any) -> Response:

    model = gw.config.find_model(model_id)
    if model is None:
        return error_response(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")
    if not model.versioned:
        return error_response(400, f"model {model.name!r} has one version; declare `versions:` in its config to "
                              "roll out between them", param="model", code="not_versioned")
    actor = gw.traffic.actor()
    if action == "start":
        overrides = kwargs["overrides"]
        try:  # the same checks as the config file's `rollout:` section
            merged = RolloutConfig.model_validate({**model.rollout.model_dump(mode="json"), **overrides})
        except ValidationError as exc:
            return error_response(400, format_config_error(exc, RolloutConfig).replace("\n", " "),
                                  code="invalid_rollout")
        call = actor.start_rollout.remote(gw.traffic.context(model), kwargs["to"], merged.model_dump(mode="json"))
    elif action == "weights":
        call = actor.set_weights.remote(gw.traffic.context(model), kwargs["weights"])
    elif action == "rollback":
        call = actor.rollback.remote(model.name)
    else:
        call = getattr(actor, action).remote(model.name)
    refused = await control_call(call, f"model {model.name}: rollout {action}", param="model")
    if refused is not None:
        return refused
    await gw.traffic.refresh_now()
    return JSONResponse(_rollout_status(gw, model), status_code=202 if action == "start" else 200)


async def control_call(call: Any, what: str, param: str) -> Response | None:
    """Await a call to the control actor: None once it went through; else the actor's refusal (409) or the
    answer to its absence (503: it is restarting or unreachable, retry)."""
    from shunter.ops.control import RolloutRefused

    try:
        await call
    except RolloutRefused as exc:  # raised in the actor; Ray re-raises it here as that class
        cause = getattr(exc, "cause", None) or exc
        return error_response(409, str(cause), param=param, code="rollout_refused")
    except Exception as exc:  # noqa: BLE001 - the control actor is restarting or unreachable
        log.warning("%s failed: %r", what, exc)
        return error_response(503, f"the rollout controller did not answer ({type(exc).__name__}); retry shortly",
                              code="control_unavailable", headers={"Retry-After": RETRY_AFTER_S})
    return None


def _rollout_status(gw: GatewayParts, model: ModelConfig) -> dict[str, Any]:
    view = gw.traffic.view(model)
    entry = (gw.traffic.state.get("rollouts") or {}).get(model.name)
    current = entry is not None and entry["context"].get("fingerprint") == model.fingerprint
    return {"model": model.name, "versions": model.version_names(),
            "weights": [{"version": v, "weight": w} for v, w in view.weights], "live": sorted(view.live),
            "weights_from": view.source, "rollout": entry["rollout"] if current else None}
