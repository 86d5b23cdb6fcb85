"""The cluster-side state of a Shunter application, and the rollout controller that changes it.

State (per application): for each model whose live state differs from its config file, the traffic
weights of its versions and which versions run ("live"); each model's latest rollout; the replicas
an operator drains ("cordoned", per deployment), which the gateways' routers send nothing new; and the
LoRA adapters an operator added or removed ("adapters", per model, over those of the config). It is kept in
Ray's internal key-value store (held by the GCS, which KubeRay can make fault tolerant), written by one
detached, named actor per application (`ShunterControl`), which also runs the rollouts.

Readers never call the actor: the gateway (version choice) and Shunter's autoscaling policy (which
versions run) read the key-value store directly, so serving does not depend on the actor being up. A
model's live state carries the fingerprint of what the config file said about its versions when the
state was written; a redeploy with other versions or weights starts from the file again.

The actor restarts on failure and reloads what it saved; its loop then carries every unfinished rollout
on from its saved state. A CLI killed mid-rollout therefore loses nothing, and neither does the actor:
only the latency samples of the step in progress, so that step judges what arrives after the restart.

The actor's commands and its loop share one event loop, and the loop awaits Ray's status in the middle of
a tick. One lock orders them: a command and a tick's decision never interleave, and a tick decides on the
rollout as it is after that await, so an operator's pause or rollback that lands meanwhile stands.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import ray

from shunter import ray_compat
from shunter.ops import metrics
from shunter.ops.rollout import (
    Gates,
    Phase,
    RemoveVersion,
    Rollout,
    RolloutSpec,
    SetWeights,
    WindowStats,
    advance,
    pause,
    percentile,
    resume,
    roll_back,
    start,
)

log = logging.getLogger("ray.serve")

NAMESPACE = "shunter"
_KV_NAMESPACE = b"shunter"
TICK_S = 1.0
_MAX_SAMPLES = 50_000  # per model under rollout: hours of traffic at tens of requests per second


def actor_name(app: str) -> str:
    return f"shunter-control-{app}"


def _key(app: str) -> bytes:
    return f"control/{app}".encode()


# ---- readers: no actor involved ---------------------------------------------------------------------

class Store(Protocol):
    """Where the state is kept: Ray's key-value store in a cluster, a dict in the unit tests."""

    def get(self, key: bytes) -> bytes | None: ...

    def put(self, key: bytes, value: bytes) -> None: ...


class RayStore:
    """Ray's internal key-value store, held by the GCS (no public API: `shunter.ray_compat`). Blocking
    calls."""

    def get(self, key: bytes) -> bytes | None:
        return ray_compat.kv_get(key, _KV_NAMESPACE)

    def put(self, key: bytes, value: bytes) -> None:
        ray_compat.kv_put(key, value, _KV_NAMESPACE)

    def keys(self, prefix: bytes) -> list[bytes]:
        return ray_compat.kv_keys(prefix, _KV_NAMESPACE)


def read_state(app: str, store: Store | None = None) -> dict[str, Any]:
    """The saved state of `app` ({} when nothing was ever saved). A blocking call to the GCS: run it off
    an event loop."""
    raw = (store or RayStore()).get(_key(app))
    return json.loads(raw) if raw else {}


def cordoned(state: dict[str, Any], deployment: str) -> frozenset[str]:
    """The replicas of `deployment` that an operator drains: routers send them nothing new."""
    return frozenset((state.get("cordoned") or {}).get(deployment, ()))


def with_cordon(state: dict[str, Any], deployment: str, replica: str, on: bool,
                running: list[str]) -> dict[str, list[str]]:
    """`state`'s cordons after cordoning (`on`) or releasing `replica`. Cordons of replicas that no
    longer run are dropped here, so the set never outgrows the deployment."""
    kept = {r for r in cordoned(state, deployment) if r in running}
    kept = kept | {replica} if on else kept - {replica}
    others = {d: rs for d, rs in (state.get("cordoned") or {}).items() if d != deployment}
    return {**others, deployment: sorted(kept)} if kept else others


def adapter_changes(state: dict[str, Any], model: str, fingerprint: str) -> dict[str, str | None]:
    """An operator's changes to `model`'s LoRA adapters, on top of its config: name -> the adapter's
    directory (added, or given new files) or None (removed). Empty when the config file says something
    else about the model's adapters since (`ModelConfig.adapters_fingerprint`): it starts from the file."""
    entry = (state.get("adapters") or {}).get(model)
    return dict(entry["changes"]) if entry and entry.get("fingerprint") == fingerprint else {}


def with_adapter(state: dict[str, Any], model: str, fingerprint: str, name: str,
                 source: str | None) -> dict[str, Any]:
    """`state`'s adapter changes after adding (`source`) or removing (None) adapter `name` of `model`."""
    changes = {**adapter_changes(state, model, fingerprint), name: source}
    return {**(state.get("adapters") or {}), model: {"fingerprint": fingerprint, "changes": changes}}


@dataclass(frozen=True)
class ModelView:
    """What serves a model now: ordered (version, weight) pairs, and the versions that run."""

    weights: tuple[tuple[str, float], ...]
    live: frozenset[str]
    source: str  # "file": as the config says; "live": changed by a rollout or the admin API


def live_entry(state: dict[str, Any], model: str, fingerprint: str) -> dict[str, Any] | None:
    """The live state of `model` ({weights, live, fingerprint}), or None when it has none for this
    config (never changed, or the file has changed since)."""
    entry = (state.get("models") or {}).get(model)
    return entry if entry and entry.get("fingerprint") == fingerprint else None


def model_view(state: dict[str, Any], model: str, fingerprint: str,
               file_weights: list[tuple[str, float]]) -> ModelView:
    entry = live_entry(state, model, fingerprint)
    if entry:
        return ModelView(tuple((v, float(w)) for v, w in entry["weights"]), frozenset(entry["live"]), "live")
    return ModelView(tuple((v, float(w)) for v, w in file_weights),
                     frozenset(v for v, w in file_weights if w > 0), "file")


@dataclass(frozen=True)
class Sample:
    """One request as the gateway saw it, for a rollout's gates."""

    version: str
    at: float  # wall-clock time it ended
    ok: bool  # False: 5xx, a broken stream, a failed attempt; client errors are not sent at all
    ttft_s: float | None  # streams only
    e2e_s: float | None  # successful requests only


def window_stats(samples: list[Sample], version: str, since: float) -> WindowStats:
    mine = [s for s in samples if s.version == version and s.at >= since]
    return WindowStats(
        requests=len(mine),
        errors=sum(1 for s in mine if not s.ok),
        ttft_p95_s=percentile([s.ttft_s for s in mine if s.ok and s.ttft_s is not None], 0.95),
        e2e_p95_s=percentile([s.e2e_s for s in mine if s.ok and s.e2e_s is not None], 0.95),
    )


# ---- the writer -------------------------------------------------------------------------------------

class RolloutRefused(ValueError):
    """A rollout command that cannot apply now; the message says why and what to do."""


class LastReplica(ValueError):
    """A cordon refused: it would leave a deployment no routable replica."""


class ShunterControl:
    """One per application, run as a Ray actor by `control`; the class itself needs no Ray, so the unit
    tests drive it directly (`store`, `clock` and `_status` are their seams). `context` arguments describe
    a model as the gateway's config has it (see `shunter.deployments.gateway.traffic.LiveVersions.context`): the actor
    holds no config of its own."""

    def __init__(self, app: str, tick_s: float = TICK_S, store: Store | None = None,
                 clock: Callable[[], float] = time.time):
        self.app = app
        self.tick_s = tick_s
        self._store = store or RayStore()
        self._clock = clock
        self.state: dict[str, Any] = {"stamp": 0, "models": {}, "rollouts": {}}
        saved = read_state(app, self._store)
        if saved:
            self.state = {"stamp": 0, "models": {}, "rollouts": {}, **saved}
        self._samples: dict[str, deque[Sample]] = {}
        self._loop: asyncio.Task[None] | None = None
        self._status: Any = None  # test seam: a callable returning serve.status()
        # Held by every command that changes the state and by each tick while it decides: see _tick.
        self._lock = asyncio.Lock()

    # -- commands ----------------------------------------------------------------------------------
    # Every command that changes the state holds the lock, so none lands inside a tick's decision.
    # `state_now` and `report` change nothing a tick decides on: they do not wait for it.

    async def state_now(self) -> dict[str, Any]:
        self._ensure_loop()
        return self.state

    async def start_rollout(self, context: dict[str, Any], to: str,
                            overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        self._ensure_loop()
        async with self._lock:
            model = context["model"]
            current = self.state["rollouts"].get(model)
            if current and current["rollout"]["phase"] != Phase.DONE.value:
                raise RolloutRefused(f"model {model!r} already has a rollout in phase "
                                     f"{current['rollout']['phase']}; wait for it, or roll it back first")
            if to not in context["versions"]:
                raise RolloutRefused(f"model {model!r} has no version {to!r} in its config; it has: "
                                     f"{', '.join(context['versions'])}")
            view = self._view(context)
            serving = [v for v, w in view.weights if w > 0]
            if serving == [to]:
                raise RolloutRefused(f"version {to!r} of model {model!r} already takes all its traffic")
            if len(serving) != 1:
                raise RolloutRefused(f"model {model!r} splits its traffic over {serving}; a rollout starts from "
                                     "one version with all of it (set the weights first)")
            spec = _spec(model, serving[0], to, {**context["rollout"], **(overrides or {})})
            rollout, actions = start(spec, self._clock())
            self._set_model(context, [(spec.new, 0.0), (spec.old, 100.0)], view.live | {spec.old, spec.new})
            self._samples[model] = deque(maxlen=_MAX_SAMPLES)
            return self._save_rollout(context, rollout, actions, "start")

    async def pause(self, model: str) -> dict[str, Any]:
        async with self._lock:
            entry = self._entry(model)
            return self._save_rollout(entry["context"], pause(self._rollout(entry), self._clock()), [], "pause")

    async def resume(self, model: str) -> dict[str, Any]:
        async with self._lock:
            entry = self._entry(model)
            return self._save_rollout(entry["context"], resume(self._rollout(entry), self._clock()), [], "resume")

    async def rollback(self, model: str, reason: str = "operator asked") -> dict[str, Any]:
        async with self._lock:
            entry = self._entry(model)
            before = self._rollout(entry)
            after, actions = roll_back(before, self._clock(), reason)
            if after is before:
                raise RolloutRefused(f"the rollout of {model!r} is {before.phase.value}; nothing to roll back")
            return self._save_rollout(entry["context"], after, actions, "rollback")

    async def set_weights(self, context: dict[str, Any], weights: list[tuple[str, float]]) -> dict[str, Any]:
        """An operator's traffic split. Versions given weight > 0 run; the others are retired."""
        self._ensure_loop()
        async with self._lock:
            model = context["model"]
            current = self.state["rollouts"].get(model)
            if current and current["rollout"]["phase"] != Phase.DONE.value:
                raise RolloutRefused(f"model {model!r} has a rollout in progress; pause or roll it back first")
            unknown = [v for v, _ in weights if v not in context["versions"]]
            if unknown:
                raise RolloutRefused(f"model {model!r} has no version {unknown[0]!r}; it has: "
                                     f"{', '.join(context['versions'])}")
            if any(not math.isfinite(w) or w < 0 for _, w in weights) or sum(w for _, w in weights) <= 0:
                raise RolloutRefused(f"weights are finite numbers, none below 0 and one above: {dict(weights)}")
            self._set_model(context, weights, frozenset(v for v, w in weights if w > 0))
            self._save()
            log.info("model %s: traffic weights set to %s by an operator", model, dict(weights))
            return self.state["models"][model]

    async def cordon(self, deployment: str, replica: str, on: bool, running: list[str],
                     keep_one: bool = False) -> list[str]:
        """Cordon (`on`) or release one replica of `deployment`, whose running replicas are `running`;
        the deployment's cordoned replicas after it. `keep_one`: refuse (LastReplica) to cordon the last
        running replica not cordoned yet. Judged here, on the one copy of the cordons, because each gateway
        sees the others' cordons only at its next read of the state: two drains through two gateways would
        both pass a gateway's own check."""
        async with self._lock:
            if on and keep_one and not set(running) - cordoned(self.state, deployment) - {replica}:
                raise LastReplica(f"replica {replica} is the last routable replica of deployment {deployment}")
            self.state["cordoned"] = with_cordon(self.state, deployment, replica, on, running)
            self._save()
        log.info("deployment %s: replica %s %s by an operator", deployment, replica,
                 "cordoned" if on else "released")
        return sorted(cordoned(self.state, deployment))

    async def set_adapter(self, model: str, fingerprint: str, name: str, source: str | None) -> dict[str, Any]:
        """An operator adds (`source`: its directory) or removes (None) LoRA adapter `name` of `model`;
        the gateway checked the request against the model's config and the adapters it knows."""
        async with self._lock:
            self.state["adapters"] = with_adapter(self.state, model, fingerprint, name, source)
            self._save()
        log.info("model %s: adapter %s %s by an operator", model, name,
                 f"served from {source}" if source else "removed")
        return adapter_changes(self.state, model, fingerprint)

    async def report(self, model: str, samples: list[tuple[str, float, bool, float | None, float | None]]) -> None:
        """The gateways' request outcomes of a model under rollout."""
        self._ensure_loop()
        bucket = self._samples.setdefault(model, deque(maxlen=_MAX_SAMPLES))
        bucket.extend(Sample(*s) for s in samples)

    # -- the loop ----------------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self._tick_all()
            await asyncio.sleep(self.tick_s)

    async def _tick_all(self) -> None:
        """One pass of the loop: a tick of every unfinished rollout, each judged on its entry as it is when
        its turn comes (an earlier model's tick awaits, and a command may land meanwhile)."""
        for model in list(self.state["rollouts"]):
            try:
                await self._tick(model)
            except Exception:  # noqa: BLE001 - one model's trouble must not stop the others' rollouts
                log.exception("rollout of model %s: tick failed; retrying", model)

    async def _tick(self, model: str) -> None:
        """Ray's status is read first, outside the lock: it is a call to the Serve controller that may take
        seconds, and an operator's pause or rollback should not wait for it. The decision is then taken
        under the lock on the rollout as it is now, read again after the await: a rollout paused, rolled
        back or replaced meanwhile is not overwritten with a step judged on what it was before. A status a
        moment old is what every tick judges anyway."""
        entry = self.state["rollouts"].get(model)
        if not _moving(entry):
            return
        context = entry["context"]
        deployments = await asyncio.to_thread(self._deployments, context)
        async with self._lock:
            entry = self.state["rollouts"].get(model)
            if _moving(entry) and entry["context"] == context:  # otherwise: the next tick reads afresh
                self._decide(model, entry, deployments)

    def _decide(self, model: str, entry: dict[str, Any], deployments: dict[str, dict[str, Any]]) -> None:
        """One step of `model`'s rollout from Ray's status of its versions and the gateways' samples."""
        r = self._rollout(entry)
        context, spec = entry["context"], r.spec
        if context.get("adapter"):
            # A LoRA adapter's versions are files: nothing starts (a replica loads either version when first
            # asked for it) and nothing needs removing (an unused version ages out of the engines' caches).
            new_ready, new_failed, removed = True, None, True
        else:
            new = deployments.get(spec.new, {})
            new_ready = new.get("running", 0) >= context["ready_replicas"] and new.get("status") == "HEALTHY"
            # A first deploy that cannot start is DEPLOY_FAILED; a scale-up from zero that cannot is
            # UNHEALTHY, triggered by the failed start (Ray keeps retrying it; the rollout does not wait).
            failed = new.get("status") == "DEPLOY_FAILED" or (
                new.get("status") == "UNHEALTHY" and new.get("trigger") == "REPLICA_STARTUP_FAILED")
            new_failed = _short(new.get("message") or "its replicas failed to start") if failed else None
            leaving = spec.old if r.phase is Phase.PROMOTED else spec.new if r.phase is Phase.ROLLING_BACK else None
            removed = leaving is not None and deployments.get(leaving, {}).get("total", 0) == 0
        samples = list(self._samples.get(model, ()))
        old_stats = new_stats = None
        if r.step_started_at is not None:
            new_stats = window_stats(samples, spec.new, r.step_started_at)
            old_stats = window_stats(samples, spec.old, r.step_started_at)
            if old_stats.requests < spec.gates.min_requests:  # little old traffic left: the whole rollout's
                old_stats = window_stats(samples, spec.old, r.started_at)
        after, actions = advance(r, self._clock(), new_ready, new_failed, old_stats, new_stats, removed)
        if after.outcome == "promoted" and r.outcome is None and context.get("adapter"):
            # The adapter's directory is the new version's from now on (saved with the rollout's end).
            self.state["adapters"] = with_adapter(self.state, context["base"], context["fingerprint"],
                                                  context["adapter"], context["sources"][spec.new])
        if after != r:
            self._save_rollout(context, after, actions, _decision(r, after))

    def _deployments(self, context: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Per version: Ray's status of its deployment and its replica counts."""
        from ray import serve

        status = self._status() if self._status else serve.status()
        app = status.applications.get(self.app)
        found: dict[str, dict[str, Any]] = {}
        for version, name in context["deployments"].items():
            dep = app.deployments.get(name) if app else None
            if dep is None:
                continue
            states = {str(getattr(k, "value", k)): n for k, n in dep.replica_states.items()}
            found[version] = {"status": str(getattr(dep.status, "value", dep.status)), "message": dep.message,
                              "trigger": str(getattr(dep.status_trigger, "value", dep.status_trigger)),
                              "running": states.get("RUNNING", 0), "total": sum(states.values())}
        return found

    # -- state -------------------------------------------------------------------------------------

    def _view(self, context: dict[str, Any]) -> ModelView:
        return model_view(self.state, context["model"], context["fingerprint"],
                          [(v, w) for v, w in context["file_weights"]])

    def _set_model(self, context: dict[str, Any], weights: list[tuple[str, float]], live: frozenset[str]) -> None:
        self.state["models"][context["model"]] = {"fingerprint": context["fingerprint"],
                                                  "weights": [[v, float(w)] for v, w in weights],
                                                  "live": sorted(live)}

    def _entry(self, model: str) -> dict[str, Any]:
        self._ensure_loop()
        entry = self.state["rollouts"].get(model)
        if entry is None:
            raise RolloutRefused(f"model {model!r} has no rollout")
        return entry

    @staticmethod
    def _rollout(entry: dict[str, Any]) -> Rollout:
        return Rollout.from_dict(entry["rollout"])

    def _save_rollout(self, context: dict[str, Any], rollout: Rollout, actions: list[Any],
                      decision: str | None) -> dict[str, Any]:
        model, spec = context["model"], rollout.spec
        entry = self.state["models"].get(model)
        live = set(entry["live"]) if entry else {spec.old}
        weights = [[v, float(w)] for v, w in entry["weights"]] if entry else [[spec.old, 100.0]]
        for action in actions:
            if isinstance(action, SetWeights):  # the incoming version first: see shunter.routing.versions
                weights = [[spec.new, float(action.weights[spec.new])], [spec.old, float(action.weights[spec.old])]]
            elif isinstance(action, RemoveVersion):
                live.discard(action.version)
        self.state["models"][model] = {"fingerprint": context["fingerprint"], "weights": weights,
                                       "live": sorted(live)}
        self.state["rollouts"][model] = {"context": context, "rollout": rollout.to_dict()}
        self._save()
        last = rollout.history[-1] if rollout.history else None
        if last is not None and decision:
            log.info("rollout of model %s: %s; phase %s, weights %s%s", model, last.reason, last.phase,
                     last.weights, f", gates {last.gates}" if last.gates else "")
        metrics.rollout(model, rollout.phase.value, rollout.step, last.gates if last else None, decision)
        return self.state["rollouts"][model]

    def _save(self) -> None:
        self.state["stamp"] += 1
        self._store.put(_key(self.app), json.dumps(self.state).encode())


# The actor keeps the class's name (Ray's actor lists show `ShunterControl`).
_Actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(ShunterControl)


def _moving(entry: dict[str, Any] | None) -> bool:
    """Whether a model's rollout entry is one a tick may move on: it exists, is not done, not paused."""
    return entry is not None and entry["rollout"]["phase"] != Phase.DONE.value and \
        entry["rollout"].get("paused_at") is None


def _spec(model: str, old: str, new: str, settings: dict[str, Any]) -> RolloutSpec:
    try:
        return RolloutSpec(model=model, old=old, new=new, steps=tuple(settings["steps"]),
                           hold_s=float(settings["hold_s"]), max_hold_s=float(settings["max_hold_s"]),
                           ready_timeout_s=float(settings["ready_timeout_s"]), gates=Gates(**settings["gates"]))
    except (TypeError, ValueError) as exc:
        raise RolloutRefused(f"invalid rollout settings: {exc}") from None


def _short(message: str) -> str:
    """Ray's failure message carries a whole traceback: keep its first line and the exception's."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) <= 1:
        return message[:400]
    return f"{lines[0][:200]} ... {lines[-1][:200]}"


def _decision(before: Rollout, after: Rollout) -> str:
    if after.phase is Phase.ROLLING_BACK:
        return "rollback"
    if after.phase is Phase.PROMOTED:
        return "promote"
    if after.phase is Phase.DONE:
        return "done"
    if before.phase is Phase.DEPLOYING:
        return "ready"
    return "step"


def control(app: str) -> Any:
    """The application's control actor, started if it is not running (call inside a Ray job)."""
    return _Actor.options(name=actor_name(app), namespace=NAMESPACE, lifetime="detached",
                          get_if_exists=True).remote(app)
