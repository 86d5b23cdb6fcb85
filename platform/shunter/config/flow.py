"""`flow_control:`: who goes first when a model is full. Priority classes, named and ordered from the most
urgent; each with how long one of its requests may wait for a slot before it is refused instead.

A request asks for a class with OpenAI's own `service_tier` field (mapped to a class by `service_tiers`;
`auto`, as at OpenAI, is the caller's default) or the `x-shunter-priority` header (a class by name); a key
has a default class and the classes it may ask for (`auth.keys[].priority_class`,
`auth.keys[].priority_classes`). Without keys, `default_class` applies and any class may be asked for.
Every reply says the tier it was served at: its class's first tier in `service_tiers`.
"""

from __future__ import annotations

import itertools

from pydantic import Field, model_validator

from shunter.config.auth import KEY_NAME_PATTERN
from shunter.config.base import StrictModel

SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")  # OpenAI's `service_tier` values
AUTO_TIER = "auto"  # OpenAI's "the caller's default": never mapped to a class of its own


class PriorityClassConfig(StrictModel):
    """One priority class."""

    name: str = Field(pattern=KEY_NAME_PATTERN, description="The class's name (interactive, batch).")
    max_wait_s: float | None = Field(
        default=None, gt=0, le=86_400,
        description="Longest one of its requests may wait for a slot when the model is full (its queueing "
        "deadline): a request expected to wait longer is refused at once with 429 and a Retry-After from the "
        "measured drain rate; one still waiting when it passes gets 503 `queue_timeout`. null = "
        "gateway.queue_timeout_s. Classes you configure must end before gateway.limits.request_timeout_s; the "
        "default classes' waits are cut to it.",
    )
    capacity_share: float = Field(
        default=1.0, gt=0, le=1,
        description="The share of what a model runs at once (replicas x max_ongoing_requests, or x "
        "engine.max_num_seqs where fewer) this class's requests may fill together with every other's; the "
        "rest stay free for more urgent classes' arrivals. The most urgent class must have 1; a class may "
        "not have more than a more urgent one.",
    )
    min_share: float = Field(
        default=0.0, ge=0, le=1,
        description="Anti-starvation: while more urgent classes keep the model full, the share of the slots "
        "that free which this class still gets when its requests wait (0.05: one in twenty). 0 = strict "
        "priority: it waits until no more urgent request does.",
    )
    price_multiplier: float = Field(
        default=1.0, ge=0, le=100,
        description="The model's `pricing` times this for a request served in this class, as the usage ledger "
        "records its cost (OpenAI's flex cheaper, priority dearer: 0.5, 2). 1 = the model's prices.",
    )


def _default_classes() -> list[PriorityClassConfig]:
    return [PriorityClassConfig(name="interactive", max_wait_s=10.0),
            PriorityClassConfig(name="standard", min_share=0.1),
            PriorityClassConfig(name="batch", max_wait_s=300.0, capacity_share=0.5, min_share=0.05)]


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
        default_factory=lambda: {"priority": "interactive", "default": "standard", "flex": "batch"},
        description="OpenAI's `service_tier` values (default, flex, scale, priority) to classes; a value not "
        "listed is a 400, and `auto` (like no tier) is always the caller's default class. A reply's "
        "`service_tier` is its class's first tier here (`default` for a class with none).",
    )

    headroom_hold_s: float | None = Field(
        default=30.0, ge=0, le=86_400,
        description="How long a class's capacity_share still holds after the last request of a more urgent "
        "class arrived. Past it, with none of theirs waiting or running, the class may fill every sequence "
        "the engines run at once (a batch alone gets the whole engine); the next urgent arrival takes the "
        "headroom back at once, and waits at most for one running sequence to end. null = always held.",
    )

    tenant_headroom: float = Field(
        default=0.0625, ge=0, le=0.5,
        description="The share of a class's sequences (at least one) that one key may not fill while another "
        "key of its class has work there or sent a request within headroom_hold_s (30 s when null): the "
        "engine does not preempt, so a flood's running sequences, of one length, end together, and a light "
        "key's request would wait for the whole wave. With it kept free, that request starts at once. "
        "0 = no headroom between keys (fair queueing alone).",
    )

    @model_validator(mode="after")
    def _known_classes(self) -> FlowControlConfig:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"flow_control.classes: names must be unique, got {names}")
        if self.default_class not in names:
            raise ValueError(f"flow_control.default_class: {self.default_class!r} is not one of the classes {names}")
        for tier, name in self.service_tiers.items():
            if tier == AUTO_TIER:
                raise ValueError("flow_control.service_tiers: `auto` cannot be mapped: it means the caller's "
                                 "default class (the key's priority_class, else default_class), as at OpenAI")
            if tier not in SERVICE_TIERS:
                raise ValueError(f"flow_control.service_tiers: {tier!r} is not an OpenAI service_tier "
                                 f"({', '.join(SERVICE_TIERS)})")
            if name not in names:
                raise ValueError(f"flow_control.service_tiers.{tier}: {name!r} is not one of the classes {names}")
        if self.classes[0].capacity_share != 1:
            raise ValueError(f"flow_control.classes[{names[0]}].capacity_share: the most urgent class may fill "
                             "every slot (1)")
        for more, less in itertools.pairwise(self.classes):
            if less.capacity_share > more.capacity_share:
                raise ValueError(f"flow_control.classes[{less.name}].capacity_share: {less.capacity_share:g} is more "
                                 f"than the more urgent {more.name}'s {more.capacity_share:g}")
        return self

    def served_tier(self, name: str) -> str:
        """The `service_tier` a reply served in class `name` says: the class's first tier, else `default`."""
        return next((tier for tier, cls in self.service_tiers.items() if cls == name), "default")

    def price_multiplier(self, name: str) -> float:
        """Class `name`'s price multiplier; 1 for a request of no class (the platform's own)."""
        return next((c.price_multiplier for c in self.classes if c.name == name), 1.0)

    def rank(self, name: str) -> int:
        """0 for the most urgent class."""
        return next(i for i, c in enumerate(self.classes) if c.name == name)

    @property
    def default_classes(self) -> bool:
        """The classes are the built-in ones (whose waits are cut to a shorter request timeout; a config that
        sets its own must fit them). Compared by value: a config passed on as a dict sets every field."""
        return [c.model_dump() for c in self.classes] == [c.model_dump() for c in _default_classes()]

    def max_wait_s(self, name: str, queue_timeout_s: float, request_timeout_s: float) -> float:
        """How long a request of class `name` may wait for a slot."""
        configured = self.classes[self.rank(name)].max_wait_s
        return min(queue_timeout_s if configured is None else configured, request_timeout_s)

    def find(self, name: str) -> PriorityClassConfig | None:
        return next((c for c in self.classes if c.name == name), None)
