"""OpenAI's Files API: `/v1/files` per client key, over the head node's BatchService
(shunter.deployments.batch).

A key sees, reads and deletes only the files it uploaded: the owner is the key's public id, and another key
asking for a file's id gets the same 404 as for an id that never existed. An admin key lists every key's
files at /admin/files. Without keys every caller is the
one anonymous owner. An upload is read whole within `batch.max_file_bytes` (413 past it, before the
multipart parser sees a byte: Starlette would spool any size to disk) and `purpose` must be `batch`, the one
purpose Shunter serves.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from shunter.deployments.gateway.api_app import KEYED
from shunter.deployments.gateway.parts import GatewayParts, Parts
from shunter.errors import ApiError

router = APIRouter()

PURPOSES = ("batch",)
UPLOAD_TIMEOUT_S = 600.0  # a whole upload's time, at the least: 200 MB at a few hundred KB/s
MAX_FILENAME = 512
MAX_LIST = 10_000


def files_on(gw: GatewayParts) -> None:
    """404 where the Files API is off, before anything is said about the caller."""
    if gw.batch is None:
        raise ApiError(404, "the Files and Batch APIs are off on this deployment (batch.enabled: false)",
                       code="not_found")


def admin_view(request: Request, gw: GatewayParts) -> None:
    """An admin key's view of every key's files and batches (401/403 otherwise), once the APIs are known on."""
    files_on(gw)
    gw.access.admin(request.headers)


def owner_of(request: Request, gw: GatewayParts) -> str:
    """The caller's key id (401/403 as for any /v1 call), once the Files API is known to be on."""
    files_on(gw)
    return gw.access.client(request.headers).key_id  # without keys: the one anonymous caller's


def _no_such_file(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")


@router.post("/v1/files", openapi_extra=KEYED)
async def upload_file(request: Request, gw: Parts) -> JSONResponse:
    owner = owner_of(request, gw)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(400, "upload a file as multipart/form-data with the fields `file` and `purpose`",
                       code="invalid_content_type")
    limit = gw.config.batch.max_file_bytes
    # The whole multipart body within the file limit (a little over it for the form's own framing).
    raw = await gw.body.read_bytes(request, limit + 64 * 1024, max(gw.config.gateway.body_timeout_s, UPLOAD_TIMEOUT_S))
    request._body = raw  # noqa: SLF001 - Starlette's form parser reads the body already read
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as exc:  # noqa: BLE001 - Starlette's MultiPartException, a malformed body
        raise ApiError(400, f"the upload is not valid multipart/form-data: {str(exc)[:200]}",
                       code="invalid_multipart") from None
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if not isinstance(purpose, str) or not purpose:
            raise ApiError(400, "missing required field `purpose`", param="purpose", code="missing_field")
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose {purpose[:64]!r} is not served here; Shunter's files are for "
                           f"{', '.join(PURPOSES)}", param="purpose", code="invalid_purpose")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "missing required field `file` (a file part of the form)", param="file",
                           code="missing_field")
        content = await upload.read()
        if len(content) > limit:
            raise ApiError(413, f"the file is {len(content)} bytes; the limit is {limit}", param="file",
                           code="file_too_large")
        if not content:
            raise ApiError(400, "the file is empty", param="file", code="empty_file")
        filename = (upload.filename or "upload").replace("\x00", "")[:MAX_FILENAME] or "upload"
    finally:
        await form.close()
    stored = await gw.batch.put_file.remote(owner, filename, purpose, content)
    return JSONResponse(stored)


@router.get("/v1/files", openapi_extra=KEYED)
async def list_files(request: Request, gw: Parts) -> JSONResponse:
    return await _list(request, gw, owner_of(request, gw))


@router.get("/admin/files", openapi_extra=KEYED)
async def list_every_file(request: Request, gw: Parts) -> JSONResponse:
    """Every key's files, each with its `owner` (the key's public id): an admin key's view."""
    admin_view(request, gw)
    return await _list(request, gw, None)


async def _list(request: Request, gw: GatewayParts, owner: str | None) -> JSONResponse:
    query = request.query_params
    purpose = query.get("purpose") or None
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "`order` must be asc or desc", param="order", code="invalid_value")
    limit = page_size(query.get("limit"), MAX_LIST, MAX_LIST)
    listed = await gw.batch.list_files.remote(owner, purpose, query.get("after") or None, limit, order == "desc")
    return JSONResponse(listed)


def page_size(value: str | None, default: int, most: int) -> int:
    """A list's `limit` query parameter: a whole number from 1 to `most` (400 otherwise), `default` when absent."""
    if value is None:
        return default
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise ApiError(400, f"`limit` must be a whole number from 1 to {most}", param="limit", code="invalid_value")
    return limit


@router.get("/v1/files/{file_id}", openapi_extra=KEYED)
async def retrieve_file(file_id: str, request: Request, gw: Parts) -> JSONResponse:
    found: dict[str, Any] | None = await gw.batch.get_file.remote(owner_of(request, gw), file_id)
    if found is None:
        raise _no_such_file(file_id)
    return JSONResponse(found)


@router.get("/v1/files/{file_id}/content", openapi_extra=KEYED)
async def file_content(file_id: str, request: Request, gw: Parts) -> Response:
    content: bytes | None = await gw.batch.file_content.remote(owner_of(request, gw), file_id)
    if content is None:
        raise _no_such_file(file_id)
    return Response(content, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", openapi_extra=KEYED)
async def delete_file(file_id: str, request: Request, gw: Parts) -> JSONResponse:
    deleted: dict[str, Any] | None = await gw.batch.delete_file.remote(owner_of(request, gw), file_id)
    if deleted is None:
        raise _no_such_file(file_id)
    return JSONResponse(deleted)
