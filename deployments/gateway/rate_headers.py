"""OpenAI's rate-limit headers on every response to a known caller, read when the response starts.

Once the door knows who is calling (`remember`), whatever the gateway answers that caller carries its
`x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers (shunter.deployments.gateway.quotas): a
reply, a refusal of its body or of its model, a model listing. They are read from the key's budgets at the
moment the response starts, not when the request was admitted, so a whole reply's headers already count
its own settled usage (the tokens the engine reported, not the reservation). A stream's headers are sent
before it has used anything: they show its reservation held, and the caller's next response the settled
books. A refusal that set its own (the quota's 429 says which budget ran out) keeps them. A key without a
quota has no limits to report and gets none, as does a caller the door could not identify (401).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from starlette.requests import Request

from shunter.auth import Caller

STATE_KEY = "shunter.rate_headers"
_PREFIX = b"x-ratelimit-"


class HeaderSource(Protocol):
    """What `rate_headers` needs of the door (shunter.deployments.gateway.access.AccessControl)."""

    def rate_headers(self, caller: Caller) -> dict[str, str]: ...


def remember(request: Request, source: HeaderSource, caller: Caller) -> None:
    """The request's caller is known: its responses carry the caller's rate-limit headers."""
    request.scope.setdefault("state", {})[STATE_KEY] = lambda: source.rate_headers(caller)


class RateLimitHeaders:
    """ASGI middleware that adds the remembered caller's rate-limit headers as the response starts."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message.get("type") == "http.response.start":
                read: Callable[[], dict[str, str]] | None = scope.get("state", {}).get(STATE_KEY)
                headers = list(message.get("headers") or [])
                if read is not None and not any(name.lower().startswith(_PREFIX) for name, _ in headers):
                    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in read().items()]
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
