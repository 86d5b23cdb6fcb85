"""`tiers:`: complexity-tier routing behind one model name (`auto`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from shunter.config.base import NAME_PATTERN, VERSION_PATTERN, StrictModel


class TierConfig(StrictModel):
    """One tier: a model, its price, and the hardest requests it takes."""

    name: str = Field(pattern=VERSION_PATTERN, description="The tier's name (small, large); in headers and metrics.")
    model: str = Field(description="The served model (name or alias) this tier sends to, and so its versions.")
    cost_per_1k_prompt_tokens: float = Field(default=0.0, ge=0, description="Price of 1000 prompt tokens.")
    cost_per_1k_completion_tokens: float = Field(default=0.0, ge=0, description="Price of 1000 generated tokens.")
    max_complexity: float = Field(
        default=1.0, ge=0, le=1,
        description="The classifier's complexity score (0 to 1) this tier takes at most; a request goes to the "
        "first tier whose bound it is under. The last tier takes everything left (its bound is not used).",
    )


class TierMonitorConfig(StrictModel):
    """Re-asks a share of lower-tier requests of the top tier, in the background, and promotes request
    classes whose answers fall short of it."""

    sample_ratio: float = Field(
        default=0.0, ge=0, le=1,
        description="Share of answered lower-tier requests re-asked of the top tier (0 = monitor off).",
    )
    embedding_model: str | None = Field(
        default=None,
        description="A served embedding model (task: embed) whose cosine similarity of the two answers is "
        "their agreement. Required when sample_ratio > 0.",
    )
    agreement_threshold: float = Field(
        default=0.8, ge=0, le=1,
        description="A class whose mean agreement over the window falls below this is promoted one tier.",
    )
    min_samples: int = Field(default=10, ge=1, description="Samples a class needs in the window before it is judged.")
    window_s: float = Field(default=900.0, gt=0, description="How far back a class's samples count, seconds.")


class TiersConfig(StrictModel):
    """Complexity-tier routing: requests to `model_name` go to the cheapest tier that can handle them."""

    model_name: str = Field(
        default="auto", pattern=NAME_PATTERN, description="The `model` clients send to be routed by complexity."
    )
    levels: list[TierConfig] = Field(
        min_length=2, description="The tiers, cheapest first; the last is the top tier (the reference)."
    )
    monitor: TierMonitorConfig = Field(
        default_factory=TierMonitorConfig, description="The quality monitor (off by default)."
    )

    @model_validator(mode="after")
    def _ordered(self) -> TiersConfig:
        names = [t.name for t in self.levels]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names repeat: {names}")
        bounds = [t.max_complexity for t in self.levels[:-1]]
        if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"levels[*].max_complexity must rise from tier to tier (got {bounds}): the cheapest "
                             "tier takes the simplest requests")
        if self.monitor.sample_ratio > 0 and not self.monitor.embedding_model:
            raise ValueError("monitor.embedding_model: the monitor compares answers by embedding; name a served "
                             "embedding model (task: embed), or set monitor.sample_ratio to 0")
        return self
