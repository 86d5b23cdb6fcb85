"""The OpenAI request bodies, as the gateway's OpenAPI schema describes them (`GET /openapi.json`).

These models document the API and drive schema-based fuzzing; they do not validate requests. The
gateway reads bodies itself (so its errors stay OpenAI-shaped and its size limits hold before parsing)
and parses them with vLLM's own request models (shunter.deployments.parsed_request), as the replica does again. Fields list the common OpenAI
parameters; others vLLM accepts pass through (`extra="allow"`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shunter.deployments.admin_schema import ADMIN_BODIES

_REF = "#/components/schemas/{model}"


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Body):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str = Field(description="A served model's name or alias (GET /v1/models lists them).")
    max_tokens: int | None = Field(default=None, ge=0, description="Most tokens to generate.")
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1, description="Choices to generate.")
    stream: bool = Field(default=False, description="Answer as server-sent events.")
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = Field(default=None, description="The end user; also keeps a conversation on one version.")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = Field(default=None, ge=1)


class EmbeddingRequest(_Body):
    model: str = Field(description="A served embedding model's name or alias.")
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class ResponseInputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]


class ResponsesRequest(_Body):
    """OpenAI's Responses API, stateless: `previous_response_id` and `background` are refused."""

    model: str = Field(description="A served generative model's name or alias.")
    input: str | list[ResponseInputMessage | dict[str, Any]] = Field(
        description="The conversation: a string, or input items (messages, function calls and their outputs).")
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(default=None, description="Function tools (type: function).")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    store: bool | None = Field(default=None, description="Accepted; nothing is stored.")
    user: str | None = None


class AnthropicTextBlock(_Body):
    type: Literal["text"] = "text"
    text: str


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicTextBlock | dict[str, Any]]


class MessagesRequest(_Body):
    """Anthropic's Messages API (`POST /v1/messages`); keys go as `x-api-key` or a bearer token."""

    model: str = Field(description="A served generative model's name or alias.")
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1, description="Most tokens to generate (required, as in Anthropic's API).")
    system: str | list[AnthropicTextBlock] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(default=None, description="Tools: name, description, input_schema.")
    tool_choice: dict[str, Any] | None = None


REQUESTS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest, EmbeddingRequest,
                                         ResponsesRequest, MessagesRequest)
BEARER = "bearer"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model` (and that takes a bearer key)."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}},
            "security": [{BEARER: []}]}


def add_components(schema: dict[str, Any]) -> dict[str, Any]:
    """Add the request models and the bearer scheme to a generated OpenAPI document."""
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for model in (*REQUESTS, *ADMIN_BODIES):
        body = model.model_json_schema(ref_template=_REF)
        schemas.update(body.pop("$defs", {}))
        schemas[model.__name__] = body
    components.setdefault("securitySchemes", {})[BEARER] = {
        "type": "http", "scheme": "bearer",
        "description": "An API key from auth.keys (/v1) or auth.admin_keys (/admin), when keys are configured."}
    return schema
