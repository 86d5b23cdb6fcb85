"""Versions of a model and the gated, step-wise rollout between them."""

from __future__ import annotations

from pydantic import Field, model_validator

from shunter.config.base import VERSION_PATTERN, StrictModel
from shunter.config.engine import EngineConfig


class VersionConfig(StrictModel):
    """One version of a model: its own weights and engine settings, its own ModelServer deployment."""

    name: str = Field(pattern=VERSION_PATTERN, description="The version's name (v1, 2024-06-rc2, ...).")
    source: str = Field(description="Weights of this version, as the model's `source`.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="vLLM engine settings of this version; keys not given here come from the model's `engine`.",
    )
    weight: float = Field(
        default=0.0,
        ge=0,
        description="Share of the model's traffic (relative to the other versions' weights) when the app "
        "starts. 0 = declared but not running: a rollout can start it. Live changes go through "
        "`shunter rollout` or `shunter weights`, which need no restart.",
    )


class GatesConfig(StrictModel):
    """How much worse than the old version the new one may be over one step's window."""

    max_error_rate_increase: float = Field(
        default=0.01, ge=0, le=1,
        description="Absolute: 0.01 = one more failed request in a hundred than the old version.",
    )
    max_ttft_p95_ratio: float = Field(default=1.5, ge=1, description="New TTFT p95 / old TTFT p95 allowed.")
    max_e2e_p95_ratio: float = Field(
        default=1.5, ge=1, description="New end-to-end p95 / old end-to-end p95 allowed."
    )
    latency_slack_s: float = Field(
        default=0.05, ge=0, description="Latency differences below this are noise, whatever the ratio."
    )
    min_requests: int = Field(
        default=20, ge=1, description="Requests the new version must serve in a step before it is judged."
    )


class RolloutConfig(StrictModel):
    """How `shunter rollout start` moves traffic to a new version (each can be overridden per rollout)."""

    steps: list[int] = Field(
        default_factory=lambda: [10, 50, 100],
        min_length=1,
        description="Percent of traffic on the new version at each step, rising, ending at 100 ([100] = one "
        "atomic switch).",
    )
    hold_s: float = Field(default=60.0, ge=0, description="How long each step holds before its gates are judged.")
    max_hold_s: float = Field(
        default=600.0, ge=0,
        description="A step with too little traffic to judge waits up to this long, then rolls back.",
    )
    ready_timeout_s: float = Field(
        default=900.0, gt=0,
        description="How long every replica of the new version has to answer a real request; else roll back.",
    )
    gates: GatesConfig = Field(default_factory=GatesConfig, description="Health gates of each step.")

    @model_validator(mode="after")
    def _steps_rise_to_100(self) -> RolloutConfig:
        if self.steps[-1] != 100 or any(not 0 < s <= 100 for s in self.steps) or \
                self.steps != sorted(set(self.steps)):
            raise ValueError(f"steps must rise strictly, each in (0, 100], and end at 100 (got {self.steps})")
        if self.max_hold_s < self.hold_s:
            raise ValueError(f"max_hold_s ({self.max_hold_s:g}) must be at least hold_s ({self.hold_s:g})")
        return self
