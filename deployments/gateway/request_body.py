"""Reading a request's body: JSON only, bounded in size and time, checked before anything parses it.

What is refused here, each with its own status and code: a body that is not declared JSON (415: a web
page cannot send one without a preflight this gateway never grants), past `gateway.max_body_bytes` (413),
slower than `gateway.body_timeout_s` (408), a slow body when every upload slot is taken (503), invalid
UTF-8 or JSON, NaN/Infinity, nesting deeper than MAX_JSON_DEPTH, a lone UTF-16 surrogate escaped anywhere in
it (a key or a value: `"\\ud800"` is valid JSON but no valid text, and every layer after this one that encodes
it, vLLM's tokenizer, its JSON replies, the gateway's own error messages, raises), anything but an object
(400). The content itself is then parsed by vLLM's own request models (`shunter.deployments.gateway.parsed_request`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from typing import Any

from fastapi import Request

from shunter.config import GatewayConfig
from shunter.deployments.gateway import parsed_request
from shunter.endpoints import Endpoint, ParsedRequest
from shunter.errors import ApiError

MAX_JSON_DEPTH = 64
FAST_BODY_S = 0.5  # a body still arriving after this needs an upload slot (gateway.max_body_reads)
# A window whose timer fired later than this behind its deadline ran on a busy event loop: the body may be
# sitting in the socket, unread by the gateway itself, so the window does not count against the client.
_LATE_S = 0.1
_PARSE_INLINE_BYTES = 64 * 1024  # bodies up to this are validated on the event loop (well under 1 ms)
# A surrogate can only enter a parsed body through a `\\uD800`-`\\uDFFF` escape (UTF-8 decoding refuses encoded
# ones): bodies without such an escape, nearly all, are never walked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class BodyReader:
    """One gateway replica's body reading, with its upload slots for slow bodies."""

    def __init__(self, config: GatewayConfig):
        self.limit, self.timeout_s = config.max_body_bytes, config.body_timeout_s
        self._upload_slots = asyncio.Semaphore(config.max_body_reads)

    async def read_json(self, request: Request, optional: bool = False) -> dict[str, Any]:
        """The request's JSON object. `optional`: an empty body is {} (admin actions with no settings)."""
        _require_json(request, optional)
        raw = await self._read(request)
        request.state.body_bytes = len(raw)
        # What a retry of this very request carries too: the place a refusal keeps is found by it.
        request.state.body_digest = hashlib.blake2b(raw, digest_size=16).digest()
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
        if nesting_depth(body) > MAX_JSON_DEPTH:
            # Deeper structures serve no OpenAI request and would strain every layer that walks them.
            raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels",
                           code="invalid_json")
        if not isinstance(body, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}",
                           code="invalid_json")
        if _SURROGATE_ESCAPE.search(text):
            where = lone_surrogate_at(body)
            if where is not None:
                raise ApiError(400, f"request body holds a lone UTF-16 surrogate escape at {where or 'its top'}: "
                               "JSON strings must be valid Unicode (a surrogate only as half of a pair)",
                               param=where or None, code="invalid_encoding")
        return body

    async def read_bytes(self, request: Request, limit: int, timeout_s: float) -> bytes:
        """A body that is not JSON (an upload), within its own `limit` and `timeout_s`, read as `_read` reads."""
        return await self._read(request, limit, timeout_s)

    async def _read(self, request: Request, limit: int | None = None, timeout_s: float | None = None) -> bytes:
        """The body, within max_body_bytes (413) and body_timeout_s (408). A body still arriving after
        FAST_BODY_S needs one of `max_body_reads` upload slots, or is refused at once (503): a request
        holds one of this replica's `max_ongoing_requests` slots while its body arrives, and without this
        bound a client trickling bodies over many connections would hold them all."""
        limit = self.limit if limit is None else limit
        timeout = self.timeout_s if timeout_s is None else timeout_s
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}",
                           code="request_too_large")
        chunks: list[bytes] = []
        reading = asyncio.ensure_future(_collect(request, limit, chunks))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        slot = False
        try:
            if not await _arrives_fast(reading, deadline):
                if self._upload_slots.locked():
                    raise ApiError(503, "too many slow request bodies are arriving at this gateway; send the "
                                   "body at once, or retry shortly", code="too_many_uploads",
                                   headers={"Retry-After": "1"})
                await self._upload_slots.acquire()
                slot = True
                done, _ = await asyncio.wait({reading}, timeout=max(0.0, deadline - loop.time()))
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


async def parse(request: Request, endpoint: Endpoint, body: dict[str, Any]) -> ParsedRequest:
    """The request parsed by the engine's own model. Small bodies are parsed on the event loop; a large
    one (up to max_body_bytes) in a thread, so it never stalls the other requests."""
    if getattr(request.state, "body_bytes", 0) < _PARSE_INLINE_BYTES:
        return parsed_request.parse(endpoint, body)
    return await asyncio.to_thread(parsed_request.parse, endpoint, body)


def model_field(body: dict[str, Any]) -> str:
    name = body.get("model")
    if name is None:
        raise ApiError(400, "missing required field 'model'", param="model", code="missing_field")
    if not isinstance(name, str):
        raise ApiError(400, f"'model' must be a string, got {type(name).__name__}", param="model",
                       code="invalid_type")
    return name


def nesting_depth(value: Any) -> int:
    """Depth of nested lists/dicts, computed without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def lone_surrogate_at(value: Any) -> str | None:
    """Where the first string holding a lone surrogate is (a dotted path, keys included; the offending
    character itself written as an escape so the answer can be encoded), or None. Walked without recursion."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _encodes(item):
                return path
        elif isinstance(item, list):
            stack.extend((child, f"{path}.{i}" if path else str(i)) for i, child in enumerate(item))
        elif isinstance(item, dict):
            for key, child in item.items():
                name = key if _encodes(key) else key.encode("utf-8", "backslashreplace").decode("ascii", "replace")
                where = f"{path}.{name}" if path else name
                if name is not key:
                    return where
                stack.append((child, where))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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


async def _arrives_fast(reading: asyncio.Future, deadline: float) -> bool:
    """Whether the body is read within a FAST_BODY_S window in which the gateway itself was responsive.

    Wall time alone would blame the client for the gateway's own lag: behind a busy event loop (a burst of
    a few hundred requests on two cores) the window's timer fires late, in the same loop pass as the reads
    of bodies that arrived whole long before, and each of them would count as slow (CI saw 503
    `too_many_uploads` for bodies sent at once). A window that ended late is tried again, up to the body's
    own deadline, so only a body that did not arrive while the loop kept time needs an upload slot."""
    loop = asyncio.get_running_loop()
    while True:
        window = min(FAST_BODY_S, deadline - loop.time())
        if window <= 0:
            return reading.done()
        started = loop.time()
        done, _ = await asyncio.wait({reading}, timeout=window)
        if done:
            return True
        if loop.time() - started - window <= _LATE_S:
            return False


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
