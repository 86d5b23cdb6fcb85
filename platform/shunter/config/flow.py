"""`flow_control:`: who goes first when a model is full. Priority classes, named and ordered from the most
urgent; each with how long one of its requests may wait for a slot before it is refused instead.

A request asks for a class with OpenAI's own `service_tier` field (mapped to a class by `service_tiers`) or
the `x-shunter-priority` header (a class by name); a key has a default class and the classes it may ask for
(`auth.keys[].priority_class`, `auth.keys[].priority_classes`). Without keys, `default_class` applies and
any class may be asked for.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from shunter.config.auth import KEY_NAME_PATTERN
from shunter.config.base import StrictModel

SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")  # OpenAI's `service_tier` values


class PriorityClassConfig(StrictModel):
    """One priority class."""

    name: str = Field(pattern=KEY_NAME_PATTERN, description="The class's name (interactive, batch).")
    max_wait_s: float = Field(
        gt=0, le=86_400,
        description="Longest one of its requests may wait for a slot when the model is full; a request "
        "expected to wait longer is refused at once with 429 and a Retry-After from the measured drain rate.",
    )


def _default_classes() -> list[PriorityClassConfig]:
    return [PriorityClassConfig(name="interactive", max_wait_s=10.0),
            PriorityClassConfig(name="standard", max_wait_s=60.0),
            PriorityClassConfig(name="batch", max_wait_s=3600.0)]


class FlowControlConfig(StrictModel):
    """Priority classes and how requests name them."""

    classes: list[PriorityClassConfig] = Field(
        default_factory=_default_classes, min_length=1,
        description="The classes, most urgent first. A waiting request of an earlier class starts before any "
        "of a later one.",
    )
    default_class: str = Field(
        default="standard", description="The class of a request that names none, from a key that names none.")
    service_tiers: dict[str, str] = Field(
        default_factory=lambda: {"priority": "interactive", "default": "standard", "auto": "standard",
                                 "flex": "batch"},
        description="OpenAI's `service_tier` values (auto, default, flex, scale, priority) to classes; a value "
        "not listed is a 400.",
    )

    @model_validator(mode="after")
    def _known_classes(self) -> FlowControlConfig:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"flow_control.classes: names must be unique, got {names}")
        if self.default_class not in names:
            raise ValueError(f"flow_control.default_class: {self.default_class!r} is not one of the classes {names}")
        for tier, name in self.service_tiers.items():
            if tier not in SERVICE_TIERS:
                raise ValueError(f"flow_control.service_tiers: {tier!r} is not an OpenAI service_tier "
                                 f"({', '.join(SERVICE_TIERS)})")
            if name not in names:
                raise ValueError(f"flow_control.service_tiers.{tier}: {name!r} is not one of the classes {names}")
        return self

    def rank(self, name: str) -> int:
        """0 for the most urgent class."""
        return next(i for i, c in enumerate(self.classes) if c.name == name)

    def find(self, name: str) -> PriorityClassConfig | None:
        return next((c for c in self.classes if c.name == name), None)
