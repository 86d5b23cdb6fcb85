"""A request's priority class, decided once at the door (issue 38, flow control).

The classes are the config's (`flow_control.classes`, most urgent first). A request asks for one with
OpenAI's own `service_tier` field (mapped by `flow_control.service_tiers`) or the `x-shunter-priority` header
(a class by name); both at once must agree. A key has a default class (`auth.keys[].priority_class`, else
`flow_control.default_class`) and the classes it may ask for (`priority_classes`, else its default and every
less urgent one): asking for another is a 403, never a silent upgrade or downgrade; an unknown class or
service tier is a 400. Without keys, every class may be asked for. The class chosen travels on the request's
context and is answered in the `x-shunter-priority` header, and in the reply's own `service_tier` (the
class's tier, `FlowControlConfig.served_tier`). vLLM's own per-request `priority` field is a 400 when set:
the engine's order is derived from the class (`engine.scheduling_policy: priority`).

`service_tier: auto` is the caller's default class, as OpenAI reads it (a key's default, not the platform's).
The Messages API has Anthropic's values: `auto`, the caller's default, and `standard_only`, the caller's
default but never more urgent than the class of OpenAI's `default` tier.
"""

from __future__ import annotations

from collections.abc import Mapping

from shunter.auth import Caller
from shunter.config import AUTO_TIER, FlowControlConfig
from shunter.endpoints import Endpoint, ParsedRequest
from shunter.errors import ApiError

PRIORITY_HEADER = "x-shunter-priority"
_ANTHROPIC_TIERS = (AUTO_TIER, "standard_only")


class PriorityClasses:
    def __init__(self, flow: FlowControlConfig):
        self.flow = flow
        self.names = [c.name for c in flow.classes]

    def resolve(self, caller: Caller, parsed: ParsedRequest, headers: Mapping[str, str]) -> str:
        """The request's class; ApiError 400 (unknown, or two that disagree, or vLLM's own `priority`) or 403
        (not this key's)."""
        endpoint, tier = parsed.endpoint, None
        if "service_tier" in parsed.body:  # Responses parses it with a default ("auto"): only a sent one counts
            # vLLM's models coerce OpenAI's field; the Messages model has no such field, so it is read raw.
            tier = parsed.body["service_tier"] if endpoint.tier_vocabulary == "anthropic" \
                else getattr(parsed.typed, "service_tier", None)
        return self._resolve(caller, getattr(parsed.typed, "priority", 0), endpoint, tier, headers)

    def for_batch(self, parsed: ParsedRequest) -> str:
        """A batch line's class: the least urgent, whatever its body asks (a batch runs on capacity nobody
        else wants: OpenAI's Batch API ignores `service_tier` too). vLLM's own `priority` is a 400 as at the door."""
        self._no_engine_priority(getattr(parsed.typed, "priority", 0))
        return self.names[-1]

    def early(self, caller: Caller, endpoint: Endpoint, body: Mapping[str, object],
              headers: Mapping[str, str]) -> str | None:
        """The class `resolve` will give a request, read from its raw JSON before the body is parsed (the
        door refuses a full model's requests before parsing them), or None where only the parsed request
        can tell (a `priority` or a `service_tier` that is not a plain string) or the request will be
        refused for its class anyway."""
        tier = body.get("service_tier")
        if body.get("priority") or not (tier is None or isinstance(tier, str)):
            return None
        try:
            return self._resolve(caller, 0, endpoint, tier, headers)
        except ApiError:
            return None

    def _resolve(self, caller: Caller, priority: object, endpoint: Endpoint, tier: object,
                 headers: Mapping[str, str]) -> str:
        self._no_engine_priority(priority)
        key = caller.config
        default = key.priority_class if key is not None and key.priority_class else self.flow.default_class
        asked = self._asked(self._tier_class(endpoint, tier, default), headers, tier)
        if asked is None or asked == default:
            return default
        if key is None:
            return asked  # no keys: any class
        allowed = key.priority_classes if key.priority_classes is not None \
            else self.names[self.flow.rank(default):]
        if asked not in allowed:
            raise ApiError(403, f"this API key ({caller.name}) may not use priority class {asked!r}; it may use "
                           f"{', '.join(allowed)}", param="service_tier", code="priority_class_not_allowed")
        return asked

    def _no_engine_priority(self, priority: object) -> None:
        if priority:  # the engine's order is the platform's to set, from the class
            raise ApiError(400, "`priority` is not accepted here; ask for a priority class with `service_tier` or "
                           f"the {PRIORITY_HEADER} header (classes: {', '.join(self.names)})", param="priority",
                           code="priority_not_allowed")

    def _tier_class(self, endpoint: Endpoint, tier: object, default: str) -> str | None:
        """The class `tier` asks for on `endpoint` (None: the caller's default); ApiError 400 for a tier the
        endpoint's vocabulary does not have."""
        if tier is None or tier == AUTO_TIER or endpoint.tier_vocabulary is None:
            return None
        if endpoint.tier_vocabulary == "anthropic":
            if tier not in _ANTHROPIC_TIERS:
                raise ApiError(400, f"service_tier {str(tier)[:64]!r} is not one of {', '.join(_ANTHROPIC_TIERS)}",
                               param="service_tier", code="unsupported_service_tier")
            standard = self.flow.service_tiers.get("default", self.flow.default_class)
            return standard if self.flow.rank(default) < self.flow.rank(standard) else None
        by_tier = self.flow.service_tiers.get(str(tier))
        if by_tier is None:
            raise ApiError(400, f"service_tier {str(tier)[:64]!r} is not served here; use one of "
                           f"{', '.join((AUTO_TIER, *self.flow.service_tiers))}", param="service_tier",
                           code="unsupported_service_tier")
        return by_tier

    def _asked(self, by_tier: str | None, headers: Mapping[str, str], tier: object) -> str | None:
        by_header = headers.get(PRIORITY_HEADER)
        if by_header is not None:
            by_header = by_header.strip()
            if by_header not in self.names:
                raise ApiError(400, f"{PRIORITY_HEADER}: {by_header[:64]!r} is not a priority class; classes: "
                               f"{', '.join(self.names)}", code="unknown_priority_class")
        if by_header is not None and by_tier is not None and by_header != by_tier:
            raise ApiError(400, f"service_tier {tier!r} asks for class {by_tier!r} but {PRIORITY_HEADER} asks for "
                           f"{by_header!r}; send one", param="service_tier", code="conflicting_priority")
        return by_header or by_tier
