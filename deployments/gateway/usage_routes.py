"""OpenAI's Usage API over the usage ledger: GET /v1/organization/usage/completions, so the tools written for
OpenAI's usage dashboards read a tenant's usage here unchanged.

Who sees what: a client key its own usage only (the ledger's rows of its key name; `api_key_id` is its public
id, shunter.auth.key_id), an admin key every key's (what /admin/usage shows, in buckets), anyone every key's
when no key is configured (as /admin is then open). OpenAI asks for an admin key here; a tenant of this
platform has no other way to read its own bill, and a client key cannot see past its own rows.

What it counts: model requests, in buckets of the asked width counted from start_time, every bucket of the page
listed (empty ones with `results: []`). `input_tokens` are the prompt tokens the key was charged, cached ones
included (of which `input_cached_tokens`), `output_tokens` the completion tokens, `num_model_requests` the
requests that reached a model: the gateways' refusal counters (429s, requests that left or timed out in the
queue, which used nothing) are not model requests, and /admin/usage counts them. `model` is the model's name, or
`<model>:<adapter>` for a LoRA adapter's requests (a fine-tuned model has a name of its own at OpenAI). The
parameters are read by shunter.deployments.gateway.usage_params; like /admin/usage, this gateway sends its own
buffered records first, and a ledger that is off or not answering is a 503.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from shunter.deployments.gateway.api_app import KEYED, RETRY_AFTER_S, error_response
from shunter.deployments.gateway.parts import Parts
from shunter.deployments.gateway.usage_params import (
    WIDTHS,
    CompletionsUsageQuery,
    Page,
    parse_completions_usage,
)

log = logging.getLogger("ray.serve")

router = APIRouter()


def _parameter(name: str, schema: dict[str, Any], description: str, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "schema": schema, "description": description}


_ARRAY = {"type": "array", "items": {"type": "string"}}
_DOC = {**KEYED, "parameters": [
    _parameter("start_time", {"type": "integer", "minimum": 0}, "The window's first second (unix seconds).", True),
    _parameter("end_time", {"type": "integer", "minimum": 0}, "The window's end, exclusive; none: now."),
    _parameter("bucket_width", {"type": "string", "enum": list(WIDTHS), "default": "1d"}, "Each bucket's width."),
    _parameter("group_by", {**_ARRAY, "items": {"type": "string", "enum": ["model", "api_key_id"]}},
               "Group each bucket's usage by these."),
    _parameter("limit", {"type": "integer", "minimum": 1}, "Buckets per page (1d: 7, at most 31; 1h: 24, at most "
               "168; 1m: 60, at most 1440)."),
    _parameter("page", {"type": "string"}, "The previous answer's next_page."),
    _parameter("models", _ARRAY, "Only these models."),
    _parameter("api_key_ids", _ARRAY, "Only these keys (their public ids)."),
]}


@router.get("/v1/organization/usage/completions", openapi_extra=_DOC)
async def completions_usage(request: Request, gw: Parts) -> Response:
    """Token usage in time buckets, OpenAI's Usage API shape: a client key's own, an admin key's every key's."""
    key = gw.access.usage_of(request.headers)
    query = parse_completions_usage(request.query_params, gw.config)
    if gw.usage is None:
        return error_response(503, "the usage ledger is off (usage.enabled: false in the config)",
                              code="usage_ledger_unavailable")
    page = query.page(time.time())
    rows: list[dict[str, Any]] = []
    if page.buckets:
        await gw.usage.flush()
        try:
            rows = await gw.usage.buckets(page.since, page.until, query.width, query.store_groups, key,
                                          query.key_ids, query.models)
        except Exception as exc:  # noqa: BLE001 - the ledger restarting or unreachable
            log.warning("usage ledger query failed: %r", exc)
            return error_response(503, f"the usage ledger did not answer ({type(exc).__name__}); retry shortly",
                                  code="usage_ledger_unavailable", headers={"Retry-After": RETRY_AFTER_S})
    return JSONResponse(completions_page(rows, query, page))


def completions_page(rows: Sequence[Mapping[str, Any]], query: CompletionsUsageQuery, page: Page) -> dict[str, Any]:
    """The answer, OpenAI's shape: every bucket of the page, each with one result per group that used a model
    (the ledger's rows, LedgerStore.buckets)."""
    by_bucket: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_bucket.setdefault(int(row["bucket"]), []).append({
            "object": "organization.usage.completions.result",
            "input_tokens": row["prompt_tokens"] or 0,  # cached included, as OpenAI counts them
            "output_tokens": row["completion_tokens"] or 0,
            "input_cached_tokens": row["cached_tokens"] or 0,
            "input_audio_tokens": 0, "output_audio_tokens": 0,
            "num_model_requests": row["requests"] or 0,
            "project_id": None, "user_id": None,
            "api_key_id": row["key_id"] if "api_key_id" in query.group_by else None,
            "model": row["model"] if "model" in query.group_by else None,
            "batch": None})
    data = [{"object": "bucket", "start_time": s, "end_time": e, "results": by_bucket.get(i, [])}
            for i, (s, e) in enumerate(page.buckets)]
    return {"object": "page", "data": data, "has_more": page.next_start is not None, "next_page": page.next_page}
