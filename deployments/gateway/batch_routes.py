"""OpenAI's Batch API: `/v1/batches` per client key, over the head node's BatchService
(shunter.deployments.batch), which runs them.

A key creates batches of its own uploaded files, and sees and cancels only its own batches (another key's
batch id gets the same 404 as one that never existed); an admin key lists every key's at /admin/batches.
The create body is checked here (OpenAI's fields, nothing else; `endpoint` one of the four a batch can call;
`completion_window` 24h); each line is checked by a gateway before the batch runs, as its endpoint checks it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from shunter.deployments.gateway.admin_schema import CreateBatchBody, parse_body
from shunter.deployments.gateway.api_app import KEYED
from shunter.deployments.gateway.files_routes import admin_view, owner_of, page_size
from shunter.deployments.gateway.openapi import request_body
from shunter.deployments.gateway.parts import GatewayParts, Parts
from shunter.errors import ApiError

router = APIRouter()

DEFAULT_LIST, MAX_LIST = 20, 100  # OpenAI's page size for batches: by default, at most


def _answer(found: dict[str, Any] | None, batch_id: str) -> JSONResponse:
    if found is None:
        raise ApiError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
    refusal = found.get("refused")
    if refusal is not None:
        raise ApiError(refusal["status"], refusal["message"], param=refusal["param"], code=refusal["code"])
    return JSONResponse(found)


@router.post("/v1/batches", openapi_extra={**KEYED, **request_body(CreateBatchBody)})
async def create_batch(request: Request, gw: Parts) -> JSONResponse:
    owner = owner_of(request, gw)
    body = parse_body(CreateBatchBody, await gw.body.read_json(request))
    created = await gw.batch.create_batch.remote(owner, body.input_file_id, body.endpoint, body.completion_window,
                                                 body.metadata)
    return _answer(created, "")


@router.get("/v1/batches", openapi_extra=KEYED)
async def list_batches(request: Request, gw: Parts) -> JSONResponse:
    return await _list(request, gw, owner_of(request, gw))


@router.get("/admin/batches", openapi_extra=KEYED)
async def list_every_batch(request: Request, gw: Parts) -> JSONResponse:
    """Every key's batches, each with its `owner` (the key's public id): an admin key's view."""
    admin_view(request, gw)
    return await _list(request, gw, None)


async def _list(request: Request, gw: GatewayParts, owner: str | None) -> JSONResponse:
    query = request.query_params
    limit = page_size(query.get("limit"), DEFAULT_LIST, MAX_LIST)
    return JSONResponse(await gw.batch.list_batches.remote(owner, query.get("after") or None, limit))


@router.get("/v1/batches/{batch_id}", openapi_extra=KEYED)
async def retrieve_batch(batch_id: str, request: Request, gw: Parts) -> JSONResponse:
    return _answer(await gw.batch.get_batch.remote(owner_of(request, gw), batch_id), batch_id)


@router.post("/v1/batches/{batch_id}/cancel", openapi_extra=KEYED)
async def cancel_batch(batch_id: str, request: Request, gw: Parts) -> JSONResponse:
    owner = owner_of(request, gw)
    await gw.body.read_json(request, optional=True)  # JSON or nothing: never a cross-site form
    return _answer(await gw.batch.cancel_batch.remote(owner, batch_id), batch_id)
