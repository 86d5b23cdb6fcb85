"""Validate once, on typed values: a request body becomes a `ParsedRequest` before anything decides on it.

The gateway parses every OpenAI request into the engine's own request model (vLLM's pydantic classes,
with vLLM's coercion: `"n": "8"` and `8.0` are 8, `"stream": "true"` is true) before any limit, quota,
tier or routing decision. Checking the raw JSON instead let strings and floats through every limit,
because vLLM coerced them only after the gateway had looked (`"max_tokens": "500"` against a limit of
64). The replica parses the same body again with the same classes, so both sides agree by construction;
the fields the gateway decides on are written back into the forwarded body as their parsed values.

What the platform reads from a request (choices, prompts in a batch, the completion tokens asked for,
streaming and usage options) is a `shunter.endpoints.ParsedRequest`, read by the endpoint's own
descriptor; nothing downstream reads the raw body for them.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import ValidationError

from shunter.endpoints import ENDPOINTS, Endpoint, ParsedRequest
from shunter.errors import ApiError, validation_error_body

# Fields of a body the gateway decides on; they are forwarded as their parsed values.
_DECIDED = ("n", "max_tokens", "max_completion_tokens", "max_output_tokens", "stream", "stream_options")


def load_json(text: str) -> Any:
    """JSON as the platform accepts it: NaN, Infinity and numbers that overflow to them are refused.
    Python's parser takes all three by default, and a non-finite number reaching arithmetic (a traffic
    weight, a temperature) turns into NaN comparisons that pass every bound."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def warm_up() -> None:
    """Import vLLM's request models now (the gateway calls this in a thread at start), and the Messages
    handler whose conversion to a chat request its reader uses (0.6 s more on the event loop otherwise)."""
    for described in ENDPOINTS.values():
        assert described.validator is not None
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages  # noqa: F401


def parse(endpoint: Endpoint, body: dict[str, Any]) -> ParsedRequest:
    """Validate `body` as vLLM will; 400 naming the field otherwise."""
    try:
        typed = endpoint.validator.validate_python(body)
    except ValidationError as exc:
        raise ApiError.from_body(400, validation_error_body(exc)) from None
    except Exception as exc:  # noqa: BLE001 - vLLM's validators raise VLLMValidationError, which pydantic does not wrap
        message = str(exc).split(" (parameter=")[0]
        raise ApiError(400, message[:500], param=getattr(exc, "parameter", None)) from None
    fields = typed.__dict__  # the parsed values (vLLM marks max_tokens deprecated: its getter warns)
    forwarded = dict(body)
    for name in _DECIDED:
        if name in body and name in fields:
            value = fields[name]
            forwarded[name] = value.model_dump(mode="json", exclude_unset=True) if hasattr(value, "model_dump") \
                else value
    return endpoint.read(endpoint, typed, forwarded)
