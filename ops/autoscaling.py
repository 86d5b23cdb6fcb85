"""Queue-depth autoscaling: how many replicas a model version needs, from the work waiting for it.

LLM replicas saturate on their engine's queue, not on CPU: the signal is the requests each engine holds
(waiting + running, reported by the replicas) plus the requests queued ahead of the replicas. The
decision is a pure function of that depth, the time and the state carried from the last decision, so
the arithmetic and the hysteresis are tested without a cluster.

- The need is `ceil(depth / target_per_replica)`, clamped to [min, max]; a count outside [min, max]
  (a new deployment, changed bounds) moves inside at once.
- Batch work (the priority classes less urgent than the default class, as the gateways count them) scales
  the model only up to `batch_max_replicas`: the need is that of the other work alone, or the need of all
  of it capped there, whichever is more. Batch soaks up idle replicas, and the ones more urgent demand
  started while they run; it starts no more on its own, nor keeps them once that demand is gone.
- Decisions start from the count Ray is already moving to, not the replicas running now, so holding
  steady while a new replica starts does not cancel it.
- Scaling up waits until the need has stayed higher for `upscale_delay_s` (a burst of one tick does not
  start an engine), except from zero: a request waiting on a model with no replica starts one at once.
- Scaling down waits until the need has stayed lower for `downscale_delay_s`, and counts a replica as
  full already at `downscale_headroom` of its target, so a depth hovering at a boundary does not flap.
  Down to zero only when nothing at all is waiting or running. No scale-down while a replica is still
  starting (its start would be wasted; the delay counts from when every replica runs), unless it has
  been starting for `MAX_START_HOLD_S` (it may never find room).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from shunter.ops import metrics
from shunter.ops.backlog import Backlog
from shunter.ops.standby import publish, serving_set


@dataclass(frozen=True)
class ScalingSettings:
    min_replicas: int
    max_replicas: int
    target_per_replica: float  # requests (waiting + running) one replica should carry
    upscale_delay_s: float
    downscale_delay_s: float
    downscale_headroom: float = 0.8  # scaling down must leave replicas at most this full
    batch_max_replicas: int | None = None  # most replicas batch-class work alone scales to (None: no cap)

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if self.target_per_replica <= 0 or not 0 < self.downscale_headroom <= 1:
            raise ValueError("target_per_replica must be > 0 and downscale_headroom in (0, 1]")


@dataclass(frozen=True)
class ScalingState:
    """Carried between decisions (Ray keeps it as the policy state, a dict)."""

    up_since: float | None = None  # when the need first rose above the current count
    down_since: float | None = None  # when it first fell below
    starting_since: float | None = None  # when a scale-down was first held for a replica still starting

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ScalingState:
        data = data or {}
        return cls(data.get("up_since"), data.get("down_since"), data.get("starting_since"))


@dataclass(frozen=True)
class Decision:
    replicas: int
    state: ScalingState
    reason: str


# The longest a scale-down waits for starting replicas: well past an engine start, even a large model's.
MAX_START_HOLD_S = 900.0


def replicas_needed(depth: float, target_per_replica: float) -> int:
    return math.ceil(max(0.0, depth) / target_per_replica)


def _need(depth: float, batch: float, per_replica: float, cap: int | None) -> int:
    """Replicas for `depth` requests of which `batch` are batch-class work, which alone scales to `cap`."""
    every = replicas_needed(depth, per_replica)
    if cap is None:
        return every
    return max(replicas_needed(depth - min(batch, depth), per_replica), min(every, cap))


def decide(current: int, depth: float, now: float, settings: ScalingSettings, state: ScalingState,
           starting: int = 0, batch: float = 0.0) -> Decision:
    """The replica count to ask for now, given `depth` requests waiting or running for this version (of
    which `batch` are batch-class work) and `starting` of the `current` replicas not running yet."""
    s = settings
    if not s.min_replicas <= current <= s.max_replicas:
        return Decision(min(s.max_replicas, max(s.min_replicas, current)), ScalingState(), "into min/max replicas")
    up_need = min(s.max_replicas, max(s.min_replicas, _need(depth, batch, s.target_per_replica, s.batch_max_replicas)))
    if current == 0 and depth > 0:
        return Decision(max(1, up_need), ScalingState(), "scale from zero: requests are waiting")
    if up_need > current:
        since = state.up_since if state.up_since is not None else now
        if now - since >= s.upscale_delay_s:
            return Decision(up_need, ScalingState(), f"depth {depth:g}{_of_batch(batch)} needs {up_need} replicas")
        return Decision(current, ScalingState(up_since=since), f"up to {up_need} pending the upscale delay")
    down_need = _need(depth, batch, s.target_per_replica * s.downscale_headroom, s.batch_max_replicas)
    if depth > 0:
        down_need = max(1, down_need)
    down_need = min(s.max_replicas, max(s.min_replicas, down_need))
    if down_need < current and starting > 0:
        # A replica still starting has not had its chance to take work: stopping it now would waste the
        # start (a min-0 model's first replica, or one whose burst passed while it loaded). But one that
        # cannot start (no node has room for it) must not pin the count up for ever.
        held = state.starting_since if state.starting_since is not None else now
        if now - held < MAX_START_HOLD_S:
            return Decision(current, ScalingState(starting_since=held),
                            f"down to {down_need} once starting replicas run")
    if down_need < current:
        since = state.down_since if state.down_since is not None else now
        if now - since >= s.downscale_delay_s:
            return Decision(down_need, ScalingState(), f"depth {depth:g}{_of_batch(batch)} fits {down_need} replicas")
        carried = state.starting_since if starting else None  # still past the hold for a replica stuck starting
        return Decision(current, ScalingState(down_since=since, starting_since=carried),
                        f"down to {down_need} pending the downscale delay")
    return Decision(current, ScalingState(), "steady")


def _of_batch(batch: float) -> str:
    return f" ({batch:g} batch)" if batch else ""


ENGINE_REQUESTS_METRIC = "engine_requests"  # what each ModelServer's record_autoscaling_stats reports


def queue_depth(ctx: Any, ongoing_stands_in: bool = True) -> float:
    """Requests waiting or running in the engines (as the replicas report them) plus those queued at
    handles ahead of every replica. Before the replicas' own reports arrive, Ray's count of ongoing
    requests stands in for the engines' (`ongoing_stands_in`), though it counts every call, readiness
    probes too; without it, only the requests queued at handles count until then."""
    reported = (ctx.aggregated_metrics or {}).get(ENGINE_REQUESTS_METRIC) or {}
    if reported:
        return float(sum(reported.values())) + float(ctx.total_queued_requests or 0)
    return float((ctx.total_num_requests if ongoing_stands_in else ctx.total_queued_requests) or 0)


class QueueDepthPolicy:
    """Ray Serve autoscaling policy (`autoscaling_config.policy.policy_function`); Ray builds it once
    with `policy_kwargs` (the model's name and the ScalingSettings fields) and calls it on every
    autoscaling tick, in the Serve controller. Each decision is exported (see `shunter.ops.metrics`).

    For one version of a versioned model, `versioning` names the version; whether it runs at all is then
    live state (`shunter.ops.control`): a retired version is held at 0 replicas, a live one is scaled as the
    settings say. That state is read from the cluster's key-value store at most every
    `LIVE_STATE_TTL_S` (this runs inside Ray's control loop, which must not wait)."""

    def __init__(self, model: str = "", versioning: dict[str, Any] | None = None, standby_replicas: int = 0,
                 **settings: Any):
        self.model = model
        self.settings = ScalingSettings(**settings)
        self.versioning = versioning
        self.standby = standby_replicas  # warm replicas kept beyond the need (shunter.ops.standby)
        self._published: tuple[list[str], list[str]] | None = None  # the serving set last written
        self._live: tuple[float, bool] | None = None  # (when read, is this version live)
        self._live_count = 1  # versions of the model live, which share its gateways' backlog
        # (when read, requests waiting in the gateways, batch-class requests waiting or running)
        self._backlog: tuple[float, Backlog] | None = None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time if ctx.current_time is not None else time.time()
        # The count Ray is already moving to, not the replicas running now: holding at the running count
        # while a new replica starts would cancel that replica.
        target = ctx.target_num_replicas if ctx.target_num_replicas is not None else ctx.current_num_replicas
        waiting, batch = self._gateway_backlog(getattr(ctx, "app_name", None) or "", now)
        # With a standby running, requests arriving before the engines' first reports are served at once
        # (routers fall back to it), so nothing waits on this tick; and Ray's ongoing count then is mostly
        # the gateways' readiness probes, which would name the standby serving with no load at all.
        depth = queue_depth(ctx, ongoing_stands_in=not self.standby) + waiting
        running = int(ctx.current_num_replicas or 0)
        version = self.versioning["version"] if self.versioning else "default"
        if self.versioning and not self._is_live(getattr(ctx, "app_name", None) or "", now):
            metrics.autoscaling(self.model, 0, running, depth, version)
            return 0, {"reason": "version retired"}
        # The standby replicas ride on top of what the load needs: the decision is about the serving ones.
        decision = decide(max(0, int(target) - self.standby), depth, now, self.settings,
                          ScalingState.from_dict(ctx.policy_state), starting=max(0, int(target) - running),
                          batch=min(batch, depth))
        state = {**decision.state.to_dict(), "reason": decision.reason}
        if self.standby:
            state["first_seen"] = self._name_serving(ctx, decision.replicas, now, version)
        metrics.autoscaling(self.model, decision.replicas + self.standby, running, depth, version)
        return decision.replicas + self.standby, state

    def _name_serving(self, ctx: Any, serving: int, now: float, version: str) -> dict[str, float]:
        """Which running replicas serve (the `serving` seen first) and which stand by; written to the store
        when that changes, for the gateways' routers. Returns the first-seen times to carry."""
        running = [r.unique_id for r in (getattr(ctx, "running_replicas", None) or [])]
        named, seen = serving_set(running, (ctx.policy_state or {}).get("first_seen") or {}, serving, now)
        standby = sorted(set(running) - set(named))
        metrics.standby(self.model, len(standby), version)
        if self._published != (named, standby):
            try:
                publish(getattr(ctx, "app_name", None) or "", ctx.deployment_name, named, standby)
                self._published = (named, standby)
            except Exception:  # noqa: BLE001 - the GCS briefly unreachable: written at a later tick
                pass
        return seen

    def _gateway_backlog(self, app: str, now: float) -> tuple[float, float]:
        """This version's share of the requests waiting in the gateways' flow queues, and of the batch-class
        requests waiting or running (read from the key-value store at most every LIVE_STATE_TTL_S: this runs
        inside Ray's control loop)."""
        if self._backlog is None or now - self._backlog[0] >= LIVE_STATE_TTL_S:
            try:
                from shunter.ops.backlog import backlog

                read = backlog(app, self.model)
            except Exception:  # noqa: BLE001 - the GCS briefly unreachable: keep the last answer
                read = self._backlog[1] if self._backlog is not None else Backlog(0, 0)
            self._backlog = (now, read)
        live = max(1, self._live_count)
        return self._backlog[1].waiting / live, self._backlog[1].batch / live

    def _is_live(self, app: str, now: float) -> bool:
        assert self.versioning is not None
        if self._live is not None and now - self._live[0] < LIVE_STATE_TTL_S:
            return self._live[1]
        v = self.versioning
        live = v["live_at_start"]
        try:
            from shunter.ops.control import live_entry, read_state

            entry = live_entry(read_state(app), v["model"], v["fingerprint"])
            if entry is not None:
                live = v["version"] in entry["live"]
                self._live_count = max(1, len(entry["live"]))
        except Exception:  # noqa: BLE001 - the GCS briefly unreachable: keep the last answer
            live = self._live[1] if self._live is not None else live
        self._live = (now, live)
        return live


LIVE_STATE_TTL_S = 1.0

