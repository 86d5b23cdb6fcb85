"""Blue-green rollouts: the state machine that moves traffic from a model's old version to a new one.

Pure: every transition is a function of the state, the time, and what was observed (is the new version
ready, how did each version serve during the step's window), so each path is tested without a cluster
and a controller that crashed resumes from the last saved state. The controller that runs it (deploys,
sets weights, removes versions) does what the returned actions say.

Phases:
- `deploying`: the new version starts beside the old one at weight 0; it must answer a real generation
  on every replica within `ready_timeout_s`, else the rollout rolls back;
- `shifting`: traffic moves through `steps` (percent to the new version). Each step holds for `hold_s`,
  then the gates compare the new version with the old over that window (error rate, TTFT p95,
  end-to-end p95, with tolerances). All pass: next step. One fails: roll back. Too few requests to
  judge: the hold goes on, up to `max_hold_s`, then the rollout rolls back (nothing proves it good);
- `promoted`: 100% on the new version; the old one is drained and removed, then `done`;
- `rolling_back`: weights back to the old version at once; the new one is drained and removed, then
  `done`.
A paused rollout holds its weights and its clock until resumed; `rollback` works in any phase before
`done`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any


class Phase(str, Enum):
    DEPLOYING = "deploying"
    SHIFTING = "shifting"
    PROMOTED = "promoted"
    ROLLING_BACK = "rolling_back"
    DONE = "done"


@dataclass(frozen=True)
class Gates:
    """How much worse than the old version the new one may be, over one step's window."""

    max_error_rate_increase: float = 0.01  # absolute: 0.01 = one more failed request in a hundred
    max_ttft_p95_ratio: float = 1.5
    max_e2e_p95_ratio: float = 1.5
    latency_slack_s: float = 0.05  # differences below this are noise, whatever the ratio
    min_requests: int = 20  # the new version's requests in the window before it can be judged


@dataclass(frozen=True)
class RolloutSpec:
    model: str
    old: str  # version names
    new: str
    steps: tuple[int, ...] = (10, 50, 100)  # percent of traffic on the new version, ending at 100
    hold_s: float = 60.0
    max_hold_s: float = 600.0
    ready_timeout_s: float = 900.0
    gates: Gates = field(default_factory=Gates)

    def __post_init__(self) -> None:
        if self.old == self.new:
            raise ValueError(f"the new version must differ from the old one ({self.old!r})")
        if not self.steps or self.steps[-1] != 100:
            raise ValueError("steps must end at 100")
        if any(not 0 < s <= 100 for s in self.steps) or list(self.steps) != sorted(set(self.steps)):
            raise ValueError("steps must rise strictly, each in (0, 100]")
        if self.hold_s < 0 or self.max_hold_s < self.hold_s or self.ready_timeout_s <= 0:
            raise ValueError("need 0 <= hold_s <= max_hold_s and ready_timeout_s > 0")


@dataclass(frozen=True)
class WindowStats:
    """How one version served during a step's window (from the platform's own metrics)."""

    requests: int = 0
    errors: int = 0  # 5xx and broken streams; client errors (4xx) are not the version's fault
    ttft_p95_s: float | None = None
    e2e_p95_s: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class GateResult:
    verdict: str  # "pass", "fail", or "wait" (too little traffic to judge)
    values: dict[str, Any]
    reason: str


def evaluate_gates(old: WindowStats, new: WindowStats, gates: Gates) -> GateResult:
    values = {
        "new_requests": new.requests, "old_requests": old.requests,
        "new_error_rate": round(new.error_rate, 4), "old_error_rate": round(old.error_rate, 4),
        "new_ttft_p95_s": new.ttft_p95_s, "old_ttft_p95_s": old.ttft_p95_s,
        "new_e2e_p95_s": new.e2e_p95_s, "old_e2e_p95_s": old.e2e_p95_s,
    }
    if new.requests and new.error_rate > old.error_rate + gates.max_error_rate_increase:
        # Judged at once, whatever the count: errors are what the first step's small share is there for.
        if new.errors >= 3 or new.requests >= gates.min_requests:
            return GateResult("fail", values, f"error rate {new.error_rate:.1%} vs {old.error_rate:.1%} "
                              f"(allowed +{gates.max_error_rate_increase:.1%})")
    if new.requests < gates.min_requests:
        return GateResult("wait", values, f"{new.requests} requests on the new version so far; "
                          f"{gates.min_requests} needed to judge")
    for name, ratio, new_v, old_v in (("TTFT p95", gates.max_ttft_p95_ratio, new.ttft_p95_s, old.ttft_p95_s),
                                      ("end-to-end p95", gates.max_e2e_p95_ratio, new.e2e_p95_s, old.e2e_p95_s)):
        if new_v is None or old_v is None:
            continue  # nothing to compare (e.g. an old version with no traffic left)
        if new_v > old_v * ratio and new_v - old_v > gates.latency_slack_s:
            return GateResult("fail", values, f"{name} {new_v:.3f}s vs {old_v:.3f}s (allowed x{ratio:g})")
    return GateResult("pass", values, "every gate passed")


@dataclass(frozen=True)
class Event:
    at: float
    phase: str
    step: int | None
    weights: dict[str, int]
    reason: str
    gates: dict[str, Any] | None = None


@dataclass(frozen=True)
class Rollout:
    spec: RolloutSpec
    phase: Phase
    started_at: float
    step: int | None = None  # index into spec.steps while shifting
    step_started_at: float | None = None
    paused_at: float | None = None
    outcome: str | None = None  # "promoted" or "rolled_back" once done
    history: tuple[Event, ...] = ()

    @property
    def weights(self) -> dict[str, int]:
        """Percent of traffic per version now."""
        s = self.spec
        if self.phase is Phase.PROMOTED or (self.phase is Phase.DONE and self.outcome == "promoted"):
            return {s.old: 0, s.new: 100}
        if self.phase is Phase.SHIFTING and self.step is not None:
            share = s.steps[self.step]
            return {s.old: 100 - share, s.new: share}
        return {s.old: 100, s.new: 0}

    @property
    def paused(self) -> bool:
        return self.paused_at is not None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["phase"] = self.phase.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Rollout:
        spec = dict(data["spec"])
        spec["gates"] = Gates(**spec["gates"])
        spec["steps"] = tuple(spec["steps"])
        history = tuple(Event(**e) for e in data.get("history", ()))
        return cls(spec=RolloutSpec(**spec), phase=Phase(data["phase"]), started_at=data["started_at"],
                   step=data.get("step"), step_started_at=data.get("step_started_at"),
                   paused_at=data.get("paused_at"), outcome=data.get("outcome"), history=history)


# ---- actions the controller carries out -------------------------------------------------------------

@dataclass(frozen=True)
class SetWeights:
    weights: dict[str, int]


@dataclass(frozen=True)
class RemoveVersion:
    version: str  # drain it, then delete its deployment


Action = SetWeights | RemoveVersion


def start(spec: RolloutSpec, now: float) -> tuple[Rollout, list[Action]]:
    """Begin: the new version deploys at weight 0 (the controller deploys it before calling this)."""
    r = Rollout(spec=spec, phase=Phase.DEPLOYING, started_at=now)
    r = _log(r, now, f"deploying {spec.new} beside {spec.old} at weight 0")
    return r, [SetWeights(r.weights)]


def advance(r: Rollout, now: float, new_ready: bool, new_failed: str | None,
            old_stats: WindowStats | None = None, new_stats: WindowStats | None = None,
            removed: bool = False) -> tuple[Rollout, list[Action]]:
    """One tick. `new_ready`: every replica of the new version answered a real request; `new_failed`:
    why the new version cannot start (None while it may still). `*_stats`: the current step's window.
    `removed`: the version being retired has been drained and deleted."""
    s = r.spec
    if r.phase is Phase.DONE or r.paused:
        return r, []
    if r.phase is Phase.DEPLOYING:
        if new_failed:
            return _roll_back(r, now, f"{s.new} failed to start: {new_failed}")
        if new_ready:
            return _enter_step(r, now, 0, f"{s.new} ready on every replica")
        if now - r.started_at >= s.ready_timeout_s:
            return _roll_back(r, now, f"{s.new} not ready within {s.ready_timeout_s:g}s")
        return r, []
    if r.phase is Phase.SHIFTING:
        assert r.step is not None and r.step_started_at is not None
        held = now - r.step_started_at
        result = evaluate_gates(old_stats or WindowStats(), new_stats or WindowStats(), s.gates)
        if result.verdict == "fail":  # judged as soon as it is visible, not at the end of the hold
            return _roll_back(r, now, f"gate failed at {s.steps[r.step]}%: {result.reason}", result.values)
        if held < s.hold_s:
            return r, []
        if result.verdict == "wait":
            if held >= s.max_hold_s:
                return _roll_back(r, now, f"could not judge {s.new} within {s.max_hold_s:g}s at "
                                  f"{s.steps[r.step]}%: {result.reason}", result.values)
            return r, []
        if r.step + 1 < len(s.steps):
            return _enter_step(r, now, r.step + 1, f"gates passed at {s.steps[r.step]}%", result.values)
        promoted = replace(r, phase=Phase.PROMOTED, step=None, step_started_at=None)
        promoted = _log(promoted, now, f"gates passed at 100%: promoted {s.new}; retiring {s.old}",
                        result.values)
        return promoted, [SetWeights(promoted.weights), RemoveVersion(s.old)]
    if r.phase in (Phase.PROMOTED, Phase.ROLLING_BACK):
        if removed:
            outcome = "promoted" if r.phase is Phase.PROMOTED else "rolled_back"
            gone = s.old if outcome == "promoted" else s.new
            done = replace(r, phase=Phase.DONE, outcome=outcome)
            return _log(done, now, f"{gone} drained and removed"), []
        return r, []
    raise AssertionError(f"unknown phase {r.phase}")


def pause(r: Rollout, now: float) -> Rollout:
    if r.phase not in (Phase.DEPLOYING, Phase.SHIFTING) or r.paused:
        return r
    return _log(replace(r, paused_at=now), now, "paused")


def resume(r: Rollout, now: float) -> Rollout:
    """The paused time does not count towards the step's hold or the ready timeout."""
    if not r.paused or r.paused_at is None:
        return r
    gap = now - r.paused_at
    moved = replace(r, paused_at=None, started_at=r.started_at + gap,
                    step_started_at=r.step_started_at + gap if r.step_started_at is not None else None)
    return _log(moved, now, "resumed")


def roll_back(r: Rollout, now: float, reason: str) -> tuple[Rollout, list[Action]]:
    """An operator's rollback: allowed until the old version is retired."""
    if r.phase in (Phase.DONE, Phase.ROLLING_BACK, Phase.PROMOTED):
        return r, []
    return _roll_back(replace(r, paused_at=None), now, reason)


def _enter_step(r: Rollout, now: float, step: int, reason: str,
                gates: dict[str, Any] | None = None) -> tuple[Rollout, list[Action]]:
    moved = replace(r, phase=Phase.SHIFTING, step=step, step_started_at=now)
    moved = _log(moved, now, f"{reason}; {moved.spec.steps[step]}% to {moved.spec.new}", gates)
    return moved, [SetWeights(moved.weights)]


def _roll_back(r: Rollout, now: float, reason: str,
               gates: dict[str, Any] | None = None) -> tuple[Rollout, list[Action]]:
    back = replace(r, phase=Phase.ROLLING_BACK, step=None, step_started_at=None)
    back = _log(back, now, f"rolling back: {reason}", gates)
    return back, [SetWeights(back.weights), RemoveVersion(r.spec.new)]


def _log(r: Rollout, now: float, reason: str, gates: dict[str, Any] | None = None) -> Rollout:
    event = Event(at=now, phase=r.phase.value, step=r.step, weights=r.weights, reason=reason, gates=gates)
    return replace(r, history=r.history + (event,))


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in (0, 1]) of a window's samples; None for no samples."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
