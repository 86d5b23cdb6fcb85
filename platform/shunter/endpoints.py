"""One descriptor per API the platform serves: everything that differs between endpoints, in one place.

The gateway and the replica never branch on an endpoint's name: they read its `Endpoint`. A descriptor
names the API's path, the model task that serves it, vLLM's request model that validates it (once, at the
gateway's door: the same class the engine's own server validates with, so both sides agree by
construction), how its request is read into the platform's `ParsedRequest` (choices, prompts in a batch,
completion tokens asked for, streaming and usage options, tools), where its prompt and completion budget
live in the body, its wire format (`shunter.wire_formats`: stream events, error envelope) and its engine
call (`shunter.engine_protocol.ServingEngine`). Adding an endpoint is one more descriptor here, one route
line, and the engine's method.

vLLM's protocol modules are imported on first use (about 5 s and 600 MB the first time: the gateway warms
them at start), so importing this module stays cheap for the CLI and the unit tests.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from pydantic import TypeAdapter

from shunter.errors import ApiError
from shunter.wire_formats import ANTHROPIC_EVENTS, OPENAI_CHUNKS, RESPONSES_EVENTS, WireFormat


@dataclass(frozen=True)
class ParsedRequest:
    """One request, validated by the engine's own request model: what the platform decides on, as typed
    values. Nothing downstream reads the raw body for these."""

    endpoint: Endpoint
    body: dict[str, Any]  # what is forwarded: the client's JSON, decided fields set to their parsed values
    typed: Any = None  # vLLM's request object (validated once; read, never re-validated, by the gateway)
    n: int = 1  # choices per prompt
    prompts: int = 1  # prompts in a completions batch, inputs of an embeddings request
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


Reader = Callable[["Endpoint", Any, dict[str, Any]], ParsedRequest]


@dataclass(frozen=True)
class Endpoint:
    """One API; see the module docstring."""

    name: str  # the wire name: ReplicaRequest.endpoint, the `endpoint` label of the metrics
    path: str
    summary: str  # the OpenAPI document's line for the route
    task: str  # the model task that serves it: generate | embed
    operation: str  # OpenTelemetry's gen_ai.operation.name
    request_model: str  # "module:Class": vLLM's pydantic request model
    read: Reader  # the validated request -> ParsedRequest
    # Its engine call: the method of the engine interface (shunter.engine_protocol.ServingEngine) that
    # serves it, given the engine and the body; not yet awaited.
    engine_call: Callable[[Any, dict[str, Any]], Awaitable[Any]]
    prompt_field: str  # the body field holding the conversation, the prompt(s) or the input(s)
    # The body field naming the completion tokens asked for (None: it generates none), and when the
    # replica fills in the platform's default: "absent" (left out or null), "null" (sent as null only: a
    # completion that leaves it out gets OpenAI's default of 16), or None (never: the API requires it).
    max_tokens_field: str | None = None
    default_max_tokens: str | None = None
    batch_limit: str | None = None  # the LimitsConfig field bounding its batch (inputs, prompts)
    batch_noun: str = "prompts in the batch"
    message_list: bool = False  # the prompt field is a conversation, bounded by limits.max_messages
    wire: WireFormat = OPENAI_CHUNKS
    tenant_cache: bool = True  # its prompt reaches the prefix cache: the tenant's cache_salt applies
    judged: bool = False  # the tier monitor compares its answers across tiers
    # Rendered before a stream starts, so a prompt vLLM would refuse mid-stream is a 400 instead.
    renders_before_stream: bool = False
    # The engine schedules it by vLLM's per-request `priority`: the gateway sets it from the request's
    # priority class for an engine with `scheduling_policy: priority` (the Messages request model has no
    # such field: the replica hands it to the chat request vLLM makes of it, shunter.vllm_compat).
    engine_priority: bool = False
    # Which `service_tier` values its requests take: OpenAI's (auto, default, flex, priority, scale, mapped
    # by flow_control.service_tiers), Anthropic's (auto, standard_only), or none.
    tier_vocabulary: Literal["openai", "anthropic"] | None = None

    @cached_property
    def validator(self) -> TypeAdapter:
        module, _, name = self.request_model.partition(":")
        return TypeAdapter(getattr(importlib.import_module(module), name))

    @property
    def generates(self) -> bool:
        return self.task == "generate"


def _finish_streaming(typed: Any) -> dict[str, Any]:
    options, stream = typed.stream_options, bool(typed.stream)
    usage = stream and options is not None and bool(options.include_usage)
    return {"n": int(typed.n or 1), "stream": stream, "usage_chunk": usage,
            "continuous_usage": usage and bool(options.continuous_usage_stats), "greedy": typed.temperature == 0}


def _read_chat(endpoint: Endpoint, typed: Any, body: dict[str, Any]) -> ParsedRequest:
    fields = typed.__dict__  # vLLM marks max_tokens deprecated: its getter warns
    asked = fields["max_completion_tokens"] if fields["max_completion_tokens"] is not None else fields["max_tokens"]
    tools = [t.model_dump(mode="json", exclude_none=True) for t in typed.tools or ()]
    return ParsedRequest(endpoint, body, typed, max_tokens=asked, messages=list(typed.messages), tools=tools,
                         tool_choice=tool_choice(typed.tool_choice, tools), **_finish_streaming(typed))


def _read_completion(endpoint: Endpoint, typed: Any, body: dict[str, Any]) -> ParsedRequest:
    return ParsedRequest(endpoint, body, typed, prompts=prompt_count(typed.prompt), max_tokens=typed.max_tokens,
                         **_finish_streaming(typed))


def _read_embedding(endpoint: Endpoint, typed: Any, body: dict[str, Any]) -> ParsedRequest:
    return ParsedRequest(endpoint, body, typed, prompts=prompt_count(getattr(typed, "input", None)), max_tokens=0)


def _read_responses(endpoint: Endpoint, typed: Any, body: dict[str, Any]) -> ParsedRequest:
    """Stateless: a Responses request cannot continue a stored response, nor run in the background (where
    a client would fetch its result later)."""
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
    return ParsedRequest(endpoint, body, typed, max_tokens=typed.max_output_tokens, stream=bool(typed.stream),
                         greedy=typed.temperature == 0, messages=items, tools=tools,
                         tool_choice=tool_choice(typed.tool_choice, tools))


def _read_messages(endpoint: Endpoint, typed: Any, body: dict[str, Any]) -> ParsedRequest:
    """Seen as the chat request vLLM's Messages handler makes of it (so its tool choice reads as chat's)."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    try:
        chat = AnthropicServingMessages.to_chat_completion_request(typed)
    except Exception as exc:  # noqa: BLE001 - vLLM's converter refuses some block combinations
        message = str(exc).split(" (parameter=")[0]
        raise ApiError(400, message[:500], param=getattr(exc, "parameter", None)) from None
    tools = [t.model_dump(mode="json", exclude_none=True) for t in chat.tools or ()]
    return ParsedRequest(endpoint, body, typed, max_tokens=typed.max_tokens, stream=bool(typed.stream),
                         greedy=typed.temperature == 0, messages=list(typed.messages), tools=tools,
                         tool_choice=tool_choice(chat.tool_choice, tools))


def tool_choice(choice: Any, tools: list[Any]) -> str | None:
    """none | auto | required | named (a function the request names), or None without tools."""
    if not tools:
        return None
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice if choice in ("none", "auto", "required") else "named"
    kind = getattr(choice, "type", None) if not isinstance(choice, dict) else choice.get("type")
    return kind if kind in ("none", "auto", "required") else "named"


def prompt_count(prompt: Any) -> int:
    """Prompts in a completions or embeddings input: a string or a list of token ids is one."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


_OPENAI = "vllm.entrypoints.openai"
CHAT = Endpoint(
    "chat", "/v1/chat/completions", "OpenAI chat completions", "generate", "chat",
    f"{_OPENAI}.chat_completion.protocol:ChatCompletionRequest", _read_chat, lambda engine, body: engine.chat(body), "messages",
    max_tokens_field="max_tokens", default_max_tokens="absent", message_list=True, judged=True,
    engine_priority=True, tier_vocabulary="openai")
COMPLETION = Endpoint(
    "completion", "/v1/completions", "OpenAI completions", "generate", "text_completion",
    f"{_OPENAI}.completion.protocol:CompletionRequest", _read_completion, lambda engine, body: engine.completion(body), "prompt",
    max_tokens_field="max_tokens", default_max_tokens="null", batch_limit="max_completion_prompts",
    judged=True, renders_before_stream=True, engine_priority=True, tier_vocabulary="openai")
EMBEDDING = Endpoint(
    "embedding", "/v1/embeddings", "OpenAI embeddings", "embed", "embeddings",
    "vllm.entrypoints.pooling.embed.protocol:EmbeddingRequest", _read_embedding, lambda engine, body: engine.embedding(body), "input",
    batch_limit="max_embedding_inputs", batch_noun="inputs", tenant_cache=False)
RESPONSES = Endpoint(
    "responses", "/v1/responses", "OpenAI's Responses API, stateless", "generate", "chat",
    f"{_OPENAI}.responses.protocol:ResponsesRequest", _read_responses, lambda engine, body: engine.responses(body), "input",
    max_tokens_field="max_output_tokens", default_max_tokens="absent", message_list=True, wire=RESPONSES_EVENTS,
    engine_priority=True, tier_vocabulary="openai")
MESSAGES = Endpoint(
    "messages", "/v1/messages", "Anthropic's Messages API", "generate", "chat",
    "vllm.entrypoints.anthropic.protocol:AnthropicMessagesRequest", _read_messages, lambda engine, body: engine.messages(body), "messages",
    max_tokens_field="max_tokens", message_list=True, wire=ANTHROPIC_EVENTS, engine_priority=True,
    tier_vocabulary="anthropic")

ENDPOINTS: dict[str, Endpoint] = {e.name: e for e in (CHAT, COMPLETION, EMBEDDING, RESPONSES, MESSAGES)}


def serving(task: str) -> list[str]:
    """The paths of the endpoints a model of `task` serves."""
    return [e.path for e in ENDPOINTS.values() if e.task == task]
