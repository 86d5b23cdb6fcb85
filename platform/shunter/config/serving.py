"""`serving:` of a model: vLLM's frontend arguments that shape the API a model offers (tool calling,
reasoning, its chat template), checked against the installed vLLM before anything starts.

These are not engine arguments (`AsyncEngineArgs`), so `engine.extra_engine_args` cannot reach them: vLLM
reads them from its server's command line (`FrontendArgs`) when it builds its OpenAI handlers, and the
replica builds those handlers the same way (`shunter.engine`). Each field is named as the vLLM argument
it sets; `test_serving_options` checks that vLLM still defines every one of them.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from shunter import vllm_compat
from shunter.config.base import StrictModel, closest


class ServingConfig(StrictModel):
    """How a generative model's API behaves beyond plain text: tools, reasoning, its chat template."""

    tool_call_parser: str | None = Field(
        default=None,
        description="vLLM's --tool-call-parser: how the model writes a tool call (hermes, llama3_json, mistral, "
        "...; the model's chat template decides which). Needed for `tools` with tool_choice auto, required or "
        "a named function. A builtin model sets its own (see `shunter models list`); null turns tools off.",
    )
    enable_auto_tool_choice: bool | None = Field(
        default=None,
        description="vLLM's --enable-auto-tool-choice: the model decides itself whether to call a tool "
        "(tool_choice auto, the default when a request sends tools). null = on whenever tool_call_parser is set.",
    )
    tool_strict_level: Literal["auto", "function", "parameter"] = Field(
        default="auto",
        description="vLLM's --tool-strict-level: how far tool calls are constrained. auto: a forced call's "
        "format (tool_choice required or a named function), and a tool's arguments to its schema where the tool "
        "says `strict: true`; function: every call's format; parameter: every call's arguments too (for a small "
        "model whose calls would not parse otherwise).",
    )
    reasoning_parser: str | None = Field(
        default=None,
        description="vLLM's --reasoning-parser (deepseek_r1, qwen3, ...): a reasoning model's thinking is "
        "returned apart from its answer (`reasoning_content` in chat, reasoning items in Responses, thinking "
        "blocks in Messages).",
    )
    chat_template: str | None = Field(
        default=None,
        description="vLLM's --chat-template: a Jinja file that replaces the model's own chat template. A path "
        "on every node that runs a replica (absolute is safest); requests can never send their own.",
    )
    response_role: str = Field(
        default="assistant", min_length=1, max_length=64,
        description="vLLM's --response-role: the role of the generated message.",
    )
    default_chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM's --default-chat-template-kwargs: variables every request's chat template sees unless "
        "the request sets its own (e.g. {enable_thinking: false} for Qwen3).",
    )

    @field_validator("tool_call_parser", "reasoning_parser")
    @classmethod
    def _parser_known(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A parser vLLM has registered (not checked where vLLM is not installed: the replica checks)."""
        known = _vllm_tool_parsers() if info.field_name == "tool_call_parser" else _vllm_reasoning_parsers()
        if value is None or not known or value in known:
            return value
        hint = closest(value, known)
        fix = f"did you mean {hint!r}? " if hint else ""
        raise ValueError(f"unknown {info.field_name.replace('_', ' ')} {value!r}; {fix}vLLM knows: {', '.join(sorted(known))}")

    @field_validator("chat_template")
    @classmethod
    def _template_readable(cls, value: str | None) -> str | None:
        if value is None:
            return value
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"chat template {value!r} is not a file (give the path of a Jinja template; "
                             "relative paths are taken from the current directory)")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat template {value!r} cannot be read: {exc}") from None
        import jinja2

        try:
            jinja2.Environment().parse(text)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template {value!r} is not valid Jinja: {exc.message} (line {exc.lineno})") \
                from None
        return str(path.resolve())

    @model_validator(mode="after")
    def _auto_needs_parser(self) -> ServingConfig:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            # vLLM's own rule (validate_parsed_serve_args), found before any replica starts.
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (the parser reads the tool calls "
                             "the model writes)")
        return self

    @property
    def auto_tool_choice(self) -> bool:
        """Whether the model may decide itself to call a tool (the null default resolved)."""
        if self.enable_auto_tool_choice is not None:
            return self.enable_auto_tool_choice
        return self.tool_call_parser is not None

    def vllm_arguments(self) -> dict[str, Any]:
        """The vLLM argument values these options set (names as vLLM's argument namespace has them)."""
        return {
            "tool_call_parser": self.tool_call_parser,
            "enable_auto_tool_choice": self.auto_tool_choice,
            "tool_strict_level": self.tool_strict_level,
            "reasoning_parser": self.reasoning_parser or "",
            "chat_template": self.chat_template,
            "response_role": self.response_role,
            "default_chat_template_kwargs": dict(self.default_chat_template_kwargs) or None,
        }


@lru_cache(maxsize=1)
def _vllm_tool_parsers() -> frozenset[str]:
    """vLLM's registered tool call parsers, or empty when vLLM is not installed (checked at replica start).
    Read from vLLM's source, not imported: every process that reads a config would pay vLLM's import."""
    return vllm_compat.registered_parser_names("tool_call_parser")


@lru_cache(maxsize=1)
def _vllm_reasoning_parsers() -> frozenset[str]:
    return vllm_compat.registered_parser_names("reasoning_parser")
