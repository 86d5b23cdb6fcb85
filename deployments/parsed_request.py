"""Validate once, on typed values: a request body becomes a `ParsedRequest` before anything decides on it.

The gateway parses every OpenAI request into the engine's own request model (vLLM's pydantic classes,
with vLLM's coercion: `"n": "8"` and `8.0` are 8, `"stream": "true"` is true) before any limit, quota,
tier or routing decision. Checking the raw JSON instead let strings and floats through every limit,
because vLLM coerced them only after the gateway had looked (`"max_tokens": "500"` against a limit of
64). The replica parses the same body again with the same classes, so both sides agree by construction;
the fields the gateway decides on are written back into the forwarded body as their parsed values.

What the platform reads from a request (choices, prompts in a batch, the completion tokens asked for,
streaming and usage options) is held here as plain typed fields; nothing downstream reads the raw body
for them.

vLLM's protocol modules are imported on first use (about 5 s and 600 MB the first time: the gateway warms
them at start, off the event loop), so importing this module stays cheap for the CLI and unit tests.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError

from shunter.errors import ApiError, validation_error_body

# Fields of a body the gateway decides on; they are forwarded as their parsed values.
_DECIDED = ("n", "max_tokens", "max_completion_tokens", "stream", "stream_options")


@dataclass(frozen=True)
class ParsedRequest:
    """One OpenAI request, validated by the engine's own request model."""

    endpoint: str  # chat | completion | embedding
    body: dict[str, Any]  # what is forwarded: the client's JSON, decided fields set to their parsed values
    n: int = 1  # choices per prompt
    prompts: int = 1  # prompts in a completions batch (each is its own engine request)
    max_tokens: int | None = None  # completion tokens asked per choice; None: the platform's default applies
    stream: bool = False
    usage_chunk: bool = False  # the client asked for the final usage chunk of a stream
    continuous_usage: bool = False  # ... and for usage on every chunk
    greedy: bool = False  # temperature 0: the answer does not depend on sampling
    messages: list[Any] = field(default_factory=list)  # chat: the conversation, as parsed
    tools: list[Any] = field(default_factory=list)  # chat: tool definitions, as parsed (JSON-ready)

    @property
    def completion_tokens_asked(self) -> int | None:
        """Completion tokens the whole request may generate (every choice of every prompt), or None when
        the platform's default applies."""
        return None if self.max_tokens is None else self.max_tokens * self.n * self.prompts


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


@cache
def _request_models() -> dict[str, TypeAdapter]:
    """vLLM's request models by endpoint (EmbeddingRequest is a union, hence TypeAdapter)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

    return {"chat": TypeAdapter(ChatCompletionRequest), "completion": TypeAdapter(CompletionRequest),
            "embedding": TypeAdapter(EmbeddingRequest)}


def warm_up() -> None:
    """Import vLLM's request models now (the gateway calls this in a thread at start)."""
    _request_models()


def parse(endpoint: str, body: dict[str, Any]) -> ParsedRequest:
    """Validate `body` as vLLM will; 400 naming the field otherwise."""
    try:
        typed = _request_models()[endpoint].validate_python(body)
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
    if endpoint == "embedding":
        return ParsedRequest(endpoint, forwarded, prompts=_prompt_count(getattr(typed, "input", None)), max_tokens=0)
    options = typed.stream_options
    stream = bool(typed.stream)
    common = {"n": int(typed.n or 1), "stream": stream,
              "usage_chunk": stream and options is not None and bool(options.include_usage),
              "continuous_usage": stream and options is not None and bool(options.include_usage)
              and bool(options.continuous_usage_stats),
              "greedy": typed.temperature == 0}
    if endpoint == "chat":
        asked = fields["max_completion_tokens"] if fields["max_completion_tokens"] is not None else fields["max_tokens"]
        tools = [t.model_dump(mode="json", exclude_none=True) for t in typed.tools or ()]
        return ParsedRequest(endpoint, forwarded, max_tokens=asked, messages=list(typed.messages), tools=tools,
                             **common)
    return ParsedRequest(endpoint, forwarded, prompts=_prompt_count(typed.prompt), max_tokens=typed.max_tokens,
                         **common)


def _prompt_count(prompt: Any) -> int:
    """Prompts in a completions or embeddings input: a string or a list of token ids is one."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1
