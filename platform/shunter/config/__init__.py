"""The Shunter application config: what goes under `args:` of a Serve application.

Every field is declared once, in the module of its section, with its description, a default that works on a laptop, and its
validation next to it. Unknown keys are errors (`extra="forbid"`), and `format_config_error` turns a
pydantic error into lines that name the field path and the fix, so a bad file fails before anything
starts. Later features (versions, routing, autoscaling, breakers, drain) add optional sections with
defaults, so existing files stay valid.

One module per section: `root` (ShunterConfig, parse_config), `model`, `engine`, `routing`,
`scaling` (autoscaling, admission, draining), `serving` (tools, reasoning, chat template), `adapters` (LoRA), `rollout` (versions, gates), `gateway` (limits), `auth`,
`observability`, `cluster`, `tiers`, `flow` (priority classes), `usage` (the usage ledger, pricing);
`explain` turns pydantic errors into readable lines. Import
from `shunter.config`, which names them all.
"""

from shunter.config.adapters import AdapterConfig
from shunter.config.auth import ApiKeyConfig, AuthConfig, KeySourceConfig
from shunter.config.base import NAME_PATTERN, VERSION_PATTERN, StrictModel
from shunter.config.cluster import ClusterConfig, NodeGroupConfig
from shunter.config.engine import EngineConfig
from shunter.config.explain import format_config_error
from shunter.config.flow import AUTO_TIER, FlowControlConfig, PriorityClassConfig
from shunter.config.gateway import GatewayConfig, LimitsConfig
from shunter.config.model import DEFAULT_VERSION, ModelConfig
from shunter.config.observability import LoggingConfig, ObservabilityConfig, TracingConfig
from shunter.config.rollout import GatesConfig, RolloutConfig, VersionConfig
from shunter.config.root import ConfigError, ShunterConfig, parse_config
from shunter.config.routing import BreakerConfig, RoutingConfig
from shunter.config.scaling import AdmissionConfig, AutoscalingConfig, DrainingConfig
from shunter.config.serving import ServingConfig
from shunter.config.tiers import TierConfig, TierMonitorConfig, TiersConfig
from shunter.config.usage import PricingConfig, UsageConfig

__all__ = [
    "AUTO_TIER",
    "AdapterConfig",
    "AdmissionConfig",
    "ApiKeyConfig",
    "AuthConfig",
    "AutoscalingConfig",
    "BreakerConfig",
    "ClusterConfig",
    "ConfigError",
    "DEFAULT_VERSION",
    "DrainingConfig",
    "EngineConfig",
    "FlowControlConfig",
    "GatesConfig",
    "GatewayConfig",
    "KeySourceConfig",
    "LimitsConfig",
    "LoggingConfig",
    "ModelConfig",
    "NAME_PATTERN",
    "NodeGroupConfig",
    "ObservabilityConfig",
    "PriorityClassConfig",
    "PricingConfig",
    "RolloutConfig",
    "RoutingConfig",
    "ServingConfig",
    "ShunterConfig",
    "StrictModel",
    "TierConfig",
    "TierMonitorConfig",
    "TiersConfig",
    "TracingConfig",
    "UsageConfig",
    "VERSION_PATTERN",
    "VersionConfig",
    "format_config_error",
    "parse_config",
]
