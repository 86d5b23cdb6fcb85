"""The gateway's FastAPI application: the OpenAPI document and the error shape.

Every error leaves the gateway as OpenAI's `{"error": {...}}` with its status, whatever raised it: an
`ApiError` from any check, FastAPI's own validation, Starlette's 404/405, or a bug (a 500 that names no
internals). The routes live in `openai_routes` and `admin_routes`; `shunter.deployments.gateway.deployment` includes
them and wraps the app in the Serve deployment.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shunter.deployments.gateway.openapi import BEARER, add_components
from shunter.errors import ApiError, error_body

log = logging.getLogger("ray.serve")

RETRY_AFTER_S = "5"
KEYED = {"security": [{BEARER: []}]}  # a route's OpenAPI entry: it takes an API key

app = FastAPI(title="Shunter", description="OpenAI-compatible multi-model gateway", docs_url=None, redoc_url=None)


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param=param, code=code), status_code=status, headers=headers)


def _openapi() -> dict[str, Any]:
    """FastAPI's document plus the request bodies the routes read themselves, and the bearer scheme."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        app.openapi_schema = add_components(get_openapi(title=app.title, version="1", description=app.description,
                                                        routes=app.routes))
    return app.openapi_schema


app.openapi = _openapi  # type: ignore[method-assign]


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(400, "invalid request")


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error in gateway for %s %s", request.method, request.url.path)
    return error_response(500, "internal error in the gateway; see the server log")
