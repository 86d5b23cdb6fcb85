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
_DECIDED = ("n", "max_tokens", "max_completion_tokens", "max_output_tokens", "stream", "stream_options")
# The body field that names the completion tokens asked for, and the one that holds the conversation.
MAX_TOKENS_FIELD = {"chat": "max_tokens", "completion": "max_tokens", "responses": "max_output_tokens",
                    "messages": "max_tokens"}
CONVERSATION_FIELD = {"chat": "messages", "completion": "prompt", "embedding": "input", "responses": "input",
                      "messages": "messages"}


@dataclass(frozen=True)
class ParsedRequest:
    """One OpenAI request, validated by the engine's own request model."""

    endpoint: str  # chat | completion | embedding | responses | messages
    body: dict[str, Any]  # what is forwarded: the client's JSON, decided fields set to their parsed values
    n: int = 1  # choices per prompt
    prompts: int = 1  # prompts in a completions batch (each is its own engine request)
    max_tokens: int | None = None  # completion tokens asked per choice; None: the platform's default applies
    stream: bool = False
    usage_chunk: bool = False  # the client asked for the final usage chunk of a stream
    continuous_usage: bool = False  # ... and for usage on every chunk
    greedy: bool = False  # temperature 0: the answer does not depend on sampling
    messages: list[Any] = field(default_factory=list)  # the conversation (Responses: its input items), as parsed
    tools: list[Any] = field(default_factory=list)  # tool definitions, as parsed (JSON-ready)
    # How the request lets the model use its tools: none | auto | required | named; None: it sends none.
    tool_choice: str | None = None

    @property
    def engine_requests(self) -> int:
        """How many requests the engine runs for it: one per prompt of a batch (or embedding input) and choice."""
        return self.prompts * self.n

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
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

    return {"chat": TypeAdapter(ChatCompletionRequest), "completion": TypeAdapter(CompletionRequest),
            "embedding": TypeAdapter(EmbeddingRequest), "responses": TypeAdapter(ResponsesRequest),
            "messages": TypeAdapter(AnthropicMessagesRequest)}


def warm_up() -> None:
    """Import vLLM's request models now (the gateway calls this in a thread at start), and the Messages
    handler whose conversion to a chat request `_messages` uses (0.6 s more on the event loop otherwise)."""
    _request_models()
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages  # noqa: F401


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
    if endpoint == "responses":
        return _responses(typed, forwarded)
    if endpoint == "messages":
        return _messages(typed, forwarded)
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
                             tool_choice=_tool_choice(typed.tool_choice, tools), **common)
    return ParsedRequest(endpoint, forwarded, prompts=_prompt_count(typed.prompt), max_tokens=typed.max_tokens,
                         **common)


def _responses(typed: Any, forwarded: dict[str, Any]) -> ParsedRequest:
    """A Responses request. Stateless: it cannot continue a stored response, nor run in the background
    (where a client would fetch its result later)."""
    if typed.previous_response_id is not None:
        raise ApiError(400, "previous_response_id is not supported: this platform serves the Responses API "
                       "stateless (nothing is stored); send the whole conversation as `input`",
                       param="previous_response_id", code="unsupported_parameter")
    if typed.background:
        raise ApiError(400, "background responses are not supported: nothing is stored to fetch them from; "
                       "stream the response instead", param="background", code="unsupported_parameter")
    items = [typed.input] if isinstance(typed.input, str) else list(typed.input or ())
    tools = [t.model_dump(mode="json", exclude_none=True) if hasattr(t, "model_dump") else t
             for t in typed.tools or ()]
    return ParsedRequest("responses", forwarded, max_tokens=typed.max_output_tokens, stream=bool(typed.stream),
                         greedy=typed.temperature == 0, messages=items, tools=tools,
                         tool_choice=_tool_choice(typed.tool_choice, tools))


def _messages(typed: Any, forwarded: dict[str, Any]) -> ParsedRequest:
    """An Anthropic Messages request, seen as the chat request vLLM's Messages handler makes of it (so its
    tool choice reads as chat's)."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    try:
        chat = AnthropicServingMessages.to_chat_completion_request(typed)
    except Exception as exc:  # noqa: BLE001 - vLLM's converter refuses some block combinations
        message = str(exc).split(" (parameter=")[0]
        raise ApiError(400, message[:500], param=getattr(exc, "parameter", None)) from None
    tools = [t.model_dump(mode="json", exclude_none=True) for t in chat.tools or ()]
    return ParsedRequest("messages", forwarded, max_tokens=typed.max_tokens, stream=bool(typed.stream),
                         greedy=typed.temperature == 0, messages=list(typed.messages), tools=tools,
                         tool_choice=_tool_choice(chat.tool_choice, tools))


def _tool_choice(choice: Any, tools: list[Any]) -> str | None:
    """none | auto | required | named (a function the request names), or None without tools."""
    if not tools:
        return None
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice if choice in ("none", "auto", "required") else "named"
    kind = getattr(choice, "type", None) if not isinstance(choice, dict) else choice.get("type")
    return kind if kind in ("none", "auto", "required") else "named"


def _prompt_count(prompt: Any) -> int:
    """Prompts in a completions or embeddings input: a string or a list of token ids is one."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1
