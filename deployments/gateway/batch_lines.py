"""A batch's lines through the gateway's own path: the door's checks, then quota, admission, flow queue and
replicas, as an interactive request of the same key would go, in the least urgent priority class.

The head node's BatchService (shunter.deployments.batch) calls two methods of a gateway replica through its
Serve handle: `check` before a batch starts (each line refused as its endpoint would refuse it: model,
allow-list, adapters, limits, vLLM's own request model; nothing admitted, nothing charged), and `run` for one
line. A line is its key's request: the key's quotas are charged, its usage reaches the ledger under the id
`<batch>-<line>` whatever how often it ran (the ledger keeps the first record of an id), and its answer comes
back as data, never as HTTP. Only whole replies: a streamed line is refused at the check.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from shunter.batch_files import BATCH_ENDPOINTS
from shunter.deployments.gateway.access import AccessControl
from shunter.deployments.gateway.forward import Forwarder, error_reply
from shunter.deployments.gateway.parsed_request import parse as parse_body
from shunter.deployments.gateway.request_body import (
    MAX_JSON_DEPTH,
    lone_surrogate_at,
    model_field,
    nesting_depth,
)
from shunter.deployments.gateway.request_end import RequestEnd
from shunter.deployments.gateway.telemetry import RequestTelemetry
from shunter.endpoints import ENDPOINTS, Endpoint
from shunter.errors import ApiError

YIELD_EVERY = 8  # lines checked between two turns of the event loop
_BY_PATH = {path: ENDPOINTS[name] for path, name in BATCH_ENDPOINTS.items()}


class BatchLines:
    def __init__(self, forwarder: Forwarder, access: AccessControl):
        self.forwarder, self.access = forwarder, access

    async def check(self, owner: str, url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
        """For each line's body: None when it would be served, else its refusal (`run`'s shape). Parsing
        is the door's CPU work: the loop is given back every few lines, so interactive requests go on."""
        endpoint = _BY_PATH[url]
        found: list[dict[str, Any] | None] = []
        for i, body in enumerate(bodies):
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
            try:
                self._context(owner, endpoint, body)
                found.append(None)
            except ApiError as refusal:
                found.append(_refusal(endpoint, refusal))
        return found

    async def run(self, owner: str, url: str, body: dict[str, Any], line_id: str) -> dict[str, Any]:
        """One line, whole: {"status", "body", "retry_after" (the refusal's Retry-After, else None),
        "code" (a refusal's error code, else None), "request_id"}."""
        endpoint = _BY_PATH[url]
        try:
            ctx = self._context(owner, endpoint, body)
        except ApiError as refusal:  # the key or the config changed since the check: its error line
            return _refusal(endpoint, refusal)
        ctx.request_id, ctx.ledger_id = line_id, line_id
        end = RequestEnd(ctx, RequestTelemetry(ctx, {}), self.forwarder.hooks)
        try:
            with end.settled_on_failure():
                response = await self.forwarder.serve(end, None)
        except ApiError as refusal:
            return _refusal(endpoint, refusal)
        answer = json.loads(bytes(response.body))
        return {"status": response.status_code, "body": answer, "retry_after": response.headers.get("retry-after"),
                "code": _code(answer), "request_id": line_id}

    def _context(self, owner: str, endpoint: Endpoint, body: dict[str, Any]):
        caller = self.access.by_key_id(owner)
        if caller is None:
            raise ApiError(401, "the API key that created this batch is no longer configured",
                           code="invalid_api_key")
        # What the door checks of a body's JSON before parsing it (the input file's reader took its lines).
        if nesting_depth(body) > MAX_JSON_DEPTH:
            raise ApiError(400, f"`body` nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        where = lone_surrogate_at(body)
        if where is not None:
            raise ApiError(400, f"`body` holds a lone UTF-16 surrogate escape at {where or 'its top'}",
                           param=where or None, code="invalid_encoding")
        name = model_field(body)
        parsed = parse_body(endpoint, body)
        if parsed.stream:
            raise ApiError(400, "a batch's requests are answered whole: `stream` must be false or left out",
                           param="stream", code="stream_not_supported")
        session = body.get("user") if isinstance(body.get("user"), str) and body.get("user") else None
        return self.forwarder.context(caller, parsed, name, {}, session, batch=True)


def _refusal(endpoint: Endpoint, refusal: ApiError) -> dict[str, Any]:
    reply = error_reply(endpoint, refusal)
    return {"status": refusal.status, "body": json.loads(bytes(reply.body)), "code": refusal.code,
            "retry_after": (refusal.headers or {}).get("Retry-After"), "request_id": None}


def _code(answer: Any) -> str | None:
    error = answer.get("error") if isinstance(answer, dict) else None
    return error.get("code") if isinstance(error, dict) else None
