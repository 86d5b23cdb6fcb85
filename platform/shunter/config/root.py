"""The root of the config (`ShunterConfig`, what goes under `args:`) and `parse_config`."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator

from shunter.catalog import BUILTIN_PREFIX
from shunter.config.adapters import AdapterConfig
from shunter.config.auth import AuthConfig
from shunter.config.base import StrictModel
from shunter.config.batch import BatchConfig
from shunter.config.cluster import ClusterConfig
from shunter.config.explain import format_config_error
from shunter.config.flow import FlowControlConfig
from shunter.config.gateway import GatewayConfig
from shunter.config.model import ModelConfig
from shunter.config.observability import ObservabilityConfig
from shunter.config.tiers import TiersConfig
from shunter.config.usage import UsageConfig


class ShunterConfig(StrictModel):
    """The application's `args`: the models to serve and how the gateway fronts them."""

    models: list[ModelConfig] = Field(min_length=1, description="The models this application serves.")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig, description="HTTP gateway settings.")
    observability: ObservabilityConfig = Field(
        default_factory=ObservabilityConfig, description="Tracing and logging (metrics need no settings)."
    )
    cluster: ClusterConfig | None = Field(
        default=None, description="The GPU nodes the app is planned for (see shunter plan). null = the live cluster."
    )
    auth: AuthConfig = Field(
        default_factory=AuthConfig, description="API keys, admin keys and per-key quotas (default: open, loudly)."
    )
    tiers: TiersConfig | None = Field(
        default=None, description="Complexity-tier routing behind one model name (`auto`); null = off."
    )
    flow_control: FlowControlConfig = Field(
        default_factory=FlowControlConfig,
        description="Priority classes: who goes first when a model is full, and how requests name their class.",
    )
    usage: UsageConfig = Field(
        default_factory=UsageConfig,
        description="The usage ledger: tokens and cost per key, model, adapter and class (GET /admin/usage).",
    )
    batch: BatchConfig = Field(
        default_factory=BatchConfig,
        description="OpenAI's Files API (`/v1/files`) per client key: where files and their records are kept.",
    )
    model_cache_dir: str | None = Field(
        default=None,
        description="Where builtin models are prepared. null = $SHUNTER_CACHE_DIR, else "
        "~/.cache/shunter/models.",
    )

    @model_validator(mode="after")
    def _names_unique(self) -> ShunterConfig:
        seen: dict[str, str] = {}
        for model in self.models:
            for name in model.names:
                if name in seen:
                    raise ValueError(
                        f"model name or alias {name!r} is used by both {seen[name]!r} and {model.name!r}; "
                        "every name and alias must be unique"
                    )
                seen[name] = model.name
        for model in self.models:
            for adapter in model.adapters:
                if adapter.name in seen:
                    raise ValueError(f"adapter {adapter.name!r} of model {model.name!r} has the name of "
                                     f"{'model' if seen[adapter.name] == adapter.name else 'an alias of'} "
                                     f"{seen[adapter.name]!r}; model, alias and adapter names must be unique")
                seen[adapter.name] = f"{model.name}:{adapter.name}"
        if self.tiers is not None:
            self._check_tiers(self.tiers, seen)
        self._check_timeouts()
        self._check_key_classes()
        for key in self.auth.keys:
            unknown = [m for m in key.models if self.find_model(m) is None and self.find_adapter(m) is None
                       and not self._all_adapters_of(m)]
            if unknown:
                raise ValueError(f"auth.keys[{key.name}].models: {unknown} are not served models, aliases, "
                                 f"adapters or `<model>:*` of a model that runs LoRA; served: "
                                 f"{[m.name for m in self.models]}")
        return self

    def _check_key_classes(self) -> None:
        flow = self.flow_control
        names = [c.name for c in flow.classes]
        for key in self.auth.keys:
            for name in [key.priority_class, *(key.priority_classes or ())]:
                if name is not None and flow.find(name) is None:
                    raise ValueError(f"auth.keys[{key.name}]: priority class {name!r} is not one of "
                                     f"flow_control.classes {names}")
            if key.priority_class is not None and key.priority_classes is not None \
                    and key.priority_class not in key.priority_classes:
                raise ValueError(f"auth.keys[{key.name}]: its priority_class {key.priority_class!r} must be among "
                                 f"its priority_classes {key.priority_classes}")

    def _check_timeouts(self) -> None:
        """Timeouts that cannot all hold: each waiting phase must end before the whole request's deadline,
        or the client gets the deadline's 504 instead of the phase's own answer."""
        gateway, limits = self.gateway, self.gateway.limits
        deadline = limits.request_timeout_s
        problems = []
        phases = [("gateway.queue_timeout_s", gateway.queue_timeout_s),
                  ("gateway.body_timeout_s", gateway.body_timeout_s),
                  ("gateway.limits.stream_idle_timeout_s", limits.stream_idle_timeout_s)]
        if not self.flow_control.default_classes:  # the defaults' waits give way to a shorter deadline
            phases += [(f"flow_control.classes[{c.name}].max_wait_s", c.max_wait_s)
                       for c in self.flow_control.classes if c.max_wait_s is not None]
        phases += [(f"models[{m.name}].autoscaling.cold_start_timeout_s", m.autoscaling.cold_start_timeout_s)
                   for m in self.models if m.autoscaling is not None and m.autoscaling.min_replicas == 0]
        for name, value in phases:
            if value >= deadline:
                problems.append(f"{name} ({value:g}s) must be shorter than gateway.limits.request_timeout_s "
                                f"({deadline:g}s)")
        if problems:
            raise ValueError("timeouts do not fit together: " + "; ".join(problems))

    def _check_tiers(self, tiers: TiersConfig, names: dict[str, str]) -> None:
        if tiers.model_name in names:
            raise ValueError(f"tiers.model_name {tiers.model_name!r} is already a model name or alias of "
                             f"{names[tiers.model_name]!r}; pick another name for tier routing")
        for tier in tiers.levels:
            model = self.find_model(tier.model)
            if model is None or model.task != "generate":
                raise ValueError(f"tiers.levels[{tier.name}].model: {tier.model!r} is not a served generative model")
        if len({self.find_model(t.model).name for t in tiers.levels}) != len(tiers.levels):  # type: ignore[union-attr]
            raise ValueError("tiers.levels: two tiers send to the same model; each tier needs its own")
        embed = tiers.monitor.embedding_model
        if embed is not None and (self.find_model(embed) is None or self.find_model(embed).task != "embed"):  # type: ignore[union-attr]
            raise ValueError(f"tiers.monitor.embedding_model: {embed!r} is not a served embedding model (task: embed)")

    def builtin_sources(self) -> list[tuple[str, str]]:
        """(label, source) of every builtin source the models run, one per model version (a model with
        `versions:` has a source per version, none of its own), e.g. ("smol version v2", "builtin:...")."""
        found = []
        for model in self.models:
            for version in model.version_names():
                source = model.for_version(version).source or ""
                if source.startswith(BUILTIN_PREFIX):
                    found.append((model.name + (f" version {version}" if model.versioned else ""), source))
        return found

    def find_model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if name in model.names:
                return model
        return None

    def _all_adapters_of(self, name: str) -> bool:
        """Whether `name` is `<model>:*` (every adapter of the model) for a model that runs LoRA."""
        base_name, colon, star = name.rpartition(":")
        base = self.find_model(base_name) if colon and star == "*" else None
        return base is not None and base.lora

    def find_adapter(self, name: str) -> tuple[ModelConfig, AdapterConfig] | None:
        """The (base model, adapter) that `name` names: an adapter's own name, or `<base>:<adapter>` (the
        base by its name or an alias)."""
        base_name, colon, adapter_name = name.rpartition(":")
        for model in self.models:
            if colon and base_name not in model.names:
                continue
            adapter = model.find_adapter(adapter_name if colon else name)
            if adapter is not None:
                return model, adapter
        return None


class ConfigError(ValueError):
    """A config that cannot be served; the message lists each problem with its field path."""


def parse_config(args: dict[str, Any] | None) -> ShunterConfig:
    """Validate raw `args` into a ShunterConfig, or raise ConfigError with readable lines."""
    if not isinstance(args, dict):
        raise ConfigError(
            "application args must be a mapping with a `models:` list, got " + type(args).__name__
        )
    try:
        return ShunterConfig.model_validate(args)
    except ValidationError as exc:
        raise ConfigError(format_config_error(exc, ShunterConfig)) from None
