"""OpenAI-shaped error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every error the platform returns goes through here, so clients (the official SDKs among them) always
get the same shape, and pydantic's raw error dumps never reach them.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

# The `type` strings OpenAI's API uses, by status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, status: int, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """Message and param are made encodable: they may quote a client's key or value, and a lone surrogate in
    one would make the error itself fail to encode (a 500 in place of the refusal)."""
    return {
        "error": {
            "message": encodable(message),
            "type": error_type(status),
            "param": encodable(param) if param is not None else None,
            "code": code if code is not None else status,
        }
    }


def encodable(text: str) -> str:
    """`text` as valid UTF-8 text: a lone surrogate becomes its escape (`\\ud800`)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    except AttributeError:  # not a string (a param given as a number): shown as text
        return str(text)
    return text


def validation_error_body(exc: ValidationError) -> dict[str, Any]:
    """A 400 body for a request that failed schema validation: each problem with its field path."""
    problems = []
    first_param = None
    for err in exc.errors(include_url=False, include_context=False):
        loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
        first_param = first_param or loc or None
        msg = err["msg"].removeprefix("Value error, ")
        problems.append(f"{loc}: {msg}" if loc else msg)
    message = "invalid request: " + "; ".join(problems[:5])
    if len(problems) > 5:
        message += f" (and {len(problems) - 5} more)"
    return error_body(message, 400, param=first_param)


def _is_union_tag(part: Any) -> bool:
    # pydantic names union branches in locations ("str", "list[int]", "function-after[...]"); they only add noise.
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "dict", "list"})


class ApiError(Exception):
    """A refusal with its OpenAI-shaped answer, raised where the reason is found and rendered once by
    the gateway: status, message, and the optional param, code and headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, param=self.param, code=self.code)

    @classmethod
    def from_body(cls, status: int, body: dict[str, Any]) -> ApiError:
        """The refusal an `error_body` describes."""
        error = body["error"]
        code = error.get("code")
        return cls(status, error["message"], param=error.get("param"), code=None if code == status else code)
