"""Routing state of one deployment, shared by everything in one process that sends to it.

Ray Serve builds a router per deployment handle inside the caller's process (the gateway). The prefix
index, the breakers and the in-flight counts live here instead, one `DeploymentRouting` per deployment
per process, so every router instance of that process and the gateway (which records how requests
ended) see the same picture. Nothing is shared across processes: each gateway replica learns from the
requests it routes itself, which is what it can observe without a remote call.

Ray runs routers on their own event loop thread while the gateway records outcomes on its own, so every
method takes the state's lock; callers use these methods, never the parts inside.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

from shunter.config import DEFAULT_VERSION, RoutingConfig
from shunter.routing import metrics
from shunter.routing.breaker import BreakerBoard, BreakerState
from shunter.routing.prefix import PrefixIndex

log = logging.getLogger("ray.serve")

# How long the state remembers that the gateway finished a request, so that a router's late report of
# sending it is not counted (see `finished`). The race it guards spans milliseconds.
_FINISHED_KEPT_S = 60.0


class DeploymentRouting:
    def __init__(self, model: str, policy: str, config: RoutingConfig, block_size: int = 16,
                 clock: Callable[[], float] = time.monotonic, version: str = DEFAULT_VERSION):
        self.model = model
        self.version = version
        self.policy = policy
        self.config = config
        self.block_size = block_size
        # A request's blocks reach a replica's report after its prefill and the next stats poll.
        self.prefix = PrefixIndex(speculation_s=max(SPECULATION_S, 3 * config.stats_period_s))
        self._prefix_reports: dict[str, Any] = {}  # replica -> the id of its last prefix report taken
        self._predictions: dict[str, tuple[float, str]] = {}  # request id -> (predicted share cached, source)
        self.breakers = BreakerBoard(config.breaker, clock, on_transition=self._breaker_changed)
        self.clock = clock
        self.inflight: dict[str, int] = {}  # replica -> requests in flight there (the size of its flights)
        # (replica, request id) dispatched and not completed -> the LoRA adapter it names (None: the base model)
        self._flights: dict[tuple[str, str], str | None] = {}
        self.replicas: set[str] = set()
        self.synced = False  # whether a router has told this process the running replicas yet
        self._departed: dict[str, float] = {}  # replica -> when it left the running set (it is draining)
        self._probes: set[str] = set()  # request ids holding a half-open probe slot
        self._prefill: dict[str, tuple[str, int]] = {}  # request id -> (replica, tokens not yet prefilled)
        self.pending: dict[str, int] = {}  # replica -> prompt tokens sent and not yet prefilled
        # request -> (replica, prompt tokens, when): chosen by a router and not yet sent (see `reserve`)
        self._reserved: dict[str, tuple[str, int, float, str | None]] = {}  # ... and the adapter it names
        self.cordoned: frozenset[str] = frozenset()  # replicas an operator drains: no new requests
        # With standby replicas (shunter.ops.standby): the replicas that serve (None: all of them), and the
        # warm ones that get requests only when none of those can take them.
        self.serving: frozenset[str] | None = None
        self.standby: frozenset[str] = frozenset()
        self._finished: set[str] = set()  # request ids the gateway is done with, kept _FINISHED_KEPT_S
        self._finished_order: deque[tuple[float, str]] = deque()
        self.adapters = AdapterResidency()
        self._lock = threading.RLock()

    def allows(self, replica: str) -> bool:
        with self._lock:
            return self.breakers.allows(replica)

    def set_cordoned(self, replicas: Iterable[str]) -> None:
        """The replicas an operator drains (`POST /admin/models/{m}/replicas/{r}/drain`), as the cluster's
        control state says: routers send them nothing new while another replica can take it."""
        cordoned = frozenset(replicas)
        with self._lock:
            if cordoned != self.cordoned:
                log.info("model %s version %s: cordoned replicas %s", self.model, self.version,
                         sorted(cordoned) or "none")
                self.cordoned = cordoned

    def set_serving(self, serving: Iterable[str], standby: Iterable[str]) -> None:
        """Which replicas serve and which stand by, as the autoscaling policy named them: routers send new
        requests to a serving one while one of them can take it, and to any running replica otherwise."""
        serving, standby = frozenset(serving), frozenset(standby)
        with self._lock:
            if (serving, standby) != (self.serving, self.standby):
                log.info("model %s version %s: serving replicas %s, standby %s", self.model, self.version,
                         sorted(serving) or "none", sorted(standby) or "none")
                self.serving, self.standby = serving, standby

    def routable(self) -> int:
        """Running replicas that take new requests: the serving ones when standby replicas are named and
        one of them runs (routers send a standby nothing then), else every running replica."""
        with self._lock:
            serving = self.replicas & self.serving if self.serving is not None else set()
            return len(serving or self.replicas)

    def load(self, replica: str) -> int:
        """Requests in flight on the replica, counting those a router chose it for and is still sending."""
        with self._lock:
            self._expire_reservations()
            return self.inflight.get(replica, 0) + sum(1 for r, *_ in self._reserved.values() if r == replica)

    def pending_prefill(self, replica: str) -> int:
        with self._lock:
            return self.pending.get(replica, 0) + sum(t for r, t, *_ in self._reserved.values() if r == replica)

    def reserve(self, request_id: str, replica: str, prefill_tokens: int = 0, adapter: str | None = None) -> None:
        """A router ranked `replica` first for the request. Ray sends it (and may wait for the replica to
        accept) before `dispatched` counts it, and routes a burst's requests concurrently meanwhile:
        without this, every request of a burst saw the same loads and piled onto one replica. A
        reservation ends when the request is dispatched or ranked again, or after RESERVATION_TTL_S."""
        with self._lock:
            self._reserved[request_id] = (replica, prefill_tokens, self.clock(), adapter)

    def unreserve(self, request_id: str) -> None:
        with self._lock:
            self._reserved.pop(request_id, None)

    def _expire_reservations(self) -> None:
        # A request cancelled while Ray routed it is never dispatched; its reservation must not linger.
        cutoff = self.clock() - RESERVATION_TTL_S
        for request_id in [k for k, (_, _, at, _) in self._reserved.items() if at < cutoff]:
            del self._reserved[request_id]

    def matched(self, replica: str, keys: tuple[bytes, ...]) -> int:
        with self._lock:
            return self.prefix.matched(replica, keys)

    def record_prefix(self, replica: str, keys: tuple[bytes, ...]) -> None:
        with self._lock:
            self.prefix.record(replica, keys, self.clock())

    def holds_adapter(self, replica: str, adapter: str) -> bool:
        with self._lock:
            return self.adapters.holds(replica, adapter)

    def adapter_waits(self, replica: str, adapter: str) -> int:
        """Turns a request for `adapter` would wait on `replica` for an adapter slot, or make others wait.
        Its engine runs `max_loras` adapters at once; vLLM's scheduler holds a request for one more back
        until one of them has no request running, and lets later requests for the running ones go first.
        So a request for an adapter that is not running waits when the slots are taken (and behind the
        adapters held back already), and one for a running adapter keeps the held-back ones waiting. Counted
        from the requests in flight there and those chosen to go there, by the adapters they name."""
        with self._lock:
            slots = self.adapters.slots(replica)
            if not slots:
                return 0
            busy = {a for (r, _), a in self._flights.items() if r == replica and a is not None}
            busy.update(a for r, _, _, a in self._reserved.values() if r == replica and a is not None)
            held_back = max(0, len(busy) - slots)
            if adapter in busy:
                return held_back
            return held_back + 1 if len(busy) >= slots else 0

    def record_adapter(self, replica: str, adapter: str) -> None:
        """A request for `adapter` was sent to `replica`: its engine holds the adapter from now on."""
        with self._lock:
            self.adapters.sent(replica, adapter)

    def sync_replicas(self, replicas: Iterable[str], stats: dict[str, dict[str, Any]] | None = None) -> None:
        """The deployment's running replicas changed (or reported new routing stats)."""
        with self._lock:
            now = self.clock()
            current = set(replicas)
            for replica in self.replicas - current:
                self._departed.setdefault(replica, now)
                metrics.breaker_forget(self.model, self.version, replica)
            for replica, since in list(self._departed.items()):
                if now - since > _DEPARTED_KEPT_S:
                    del self._departed[replica]
            for replica in current - self.replicas:  # a series per replica from the start: 0 = closed
                metrics.breaker_state(self.model, self.version, replica, self.breakers.state(replica).level)
            self.replicas = current
            self.synced = True
            self.prefix.retain(self.replicas)
            self._prefix_reports = {r: v for r, v in self._prefix_reports.items() if r in self.replicas}
            self.adapters.retain(self.replicas)
            self.breakers.retain(self.replicas)
            for replica in [r for r in self.inflight if r not in self.replicas]:
                del self.inflight[replica]
            self._flights = {f: a for f, a in self._flights.items() if f[0] in self.replicas}
            for replica in [r for r in self.pending if r not in self.replicas]:
                del self.pending[replica]
            for request_id in [k for k, (r, *_) in self._reserved.items() if r not in self.replicas]:
                del self._reserved[request_id]
            for replica, reported in (stats or {}).items():
                blocks = reported.get("kv_cache_blocks")
                if blocks:
                    self.prefix.set_capacity(replica, int(blocks))
                if reported.get("block_size"):
                    self.block_size = int(reported["block_size"])
                self._take_prefix_report(replica, reported)
                if "adapters" in reported:
                    self.adapters.reported(replica, reported["adapters"], reported.get("adapter_capacity"),
                                           reported.get("adapter_slots"))

    def _take_prefix_report(self, replica: str, reported: dict[str, Any]) -> None:
        """Precise prefix routing: the keys the replica's engine really holds (`prefix_keys`, from its KV
        events), each report taken once (Ray hands the same stats again until the next poll)."""
        if self.config.prefix_source == "approximate" or "prefix_keys" not in reported:
            return
        report = reported.get("prefix_report")
        if report is not None and self._prefix_reports.get(replica) == report:
            return
        self._prefix_reports[replica] = report
        if reported.get("prefix_exact") is False:  # events were lost: its view is being rebuilt
            self.prefix.unreported(replica)
            return
        self.prefix.reported(replica, reported["prefix_keys"] or (), self.clock())

    def prefix_source(self, replica: str) -> str:
        """How this replica's cache is known: "precise" (its engine's report) or "approximate"."""
        with self._lock:
            return "precise" if self.prefix.is_precise(replica) else "approximate"

    def departed_at(self, replica: str) -> float | None:
        """When `replica` left the running set (Ray is stopping it; it drains), or None if it has not."""
        with self._lock:
            return self._departed.get(replica)

    def forget(self, replica: str) -> None:
        """A replica died: nothing it held survives it."""
        with self._lock:
            if replica in self.replicas:
                self._departed.setdefault(replica, self.clock())
            self.replicas.discard(replica)
            self.prefix.drop(replica)
            self._prefix_reports.pop(replica, None)
            self.adapters.retain(self.replicas)
            self.inflight.pop(replica, None)
            self._flights = {f: a for f, a in self._flights.items() if f[0] != replica}
            self.pending.pop(replica, None)
            for request_id in [k for k, (r, *_) in self._reserved.items() if r == replica]:
                del self._reserved[request_id]

    def dispatched(self, replica: str, request_id: str, prefill_tokens: int = 0, adapter: str | None = None) -> None:
        with self._lock:
            if request_id in self._finished:
                return  # reported after the gateway finished it (see `finished`): nothing is in flight
            if (replica, request_id) not in self._flights:
                self._flights[(replica, request_id)] = adapter
                self.inflight[replica] = self.inflight.get(replica, 0) + 1
            if self.breakers.on_dispatch(replica):
                self._probes.add(request_id)
            if prefill_tokens > 0:
                self._prefilled(request_id)
                self._prefill[request_id] = (replica, prefill_tokens)
                self.pending[replica] = self.pending.get(replica, 0) + prefill_tokens

    def first_byte(self, request_id: str) -> None:
        """The replica answered (its first chunk, or a whole reply): the request's prefill is done."""
        with self._lock:
            self._prefilled(request_id)

    def completed(self, replica: str, request_id: str) -> None:
        """The request ended on the replica. Both the router (when Ray reports the call done) and the
        gateway (when it stops relaying: Ray does not report every cancelled or failed stream) say so;
        the second call changes nothing."""
        with self._lock:
            if (replica, request_id) in self._flights:
                del self._flights[(replica, request_id)]
                self.inflight[replica] -= 1
            self._prefilled(request_id)  # failed or cancelled before answering: its prefill is gone too
            if request_id in self._probes:  # only a probe frees a probe slot
                self._probes.discard(request_id)
                self.breakers.on_probe_done(replica)

    def predicted(self, request_id: str, replica: str, share: float) -> None:
        """What share of the request's prompt the router believed the chosen replica held: compared with
        what its engine really had cached when the request finishes (`finished`)."""
        with self._lock:
            self._predictions[request_id] = (share, self.prefix_source(replica))
            while len(self._predictions) > _PREDICTIONS_KEPT:  # requests whose end was never reported
                self._predictions.pop(next(iter(self._predictions)))

    def prediction(self, request_id: str) -> tuple[float, str] | None:
        """(predicted share of the prompt cached, source) of a routed request not finished yet."""
        with self._lock:
            return self._predictions.get(request_id)

    def finished(self, request_id: str, cached_tokens: int | None = None, prompt_tokens: int = 0) -> None:
        """The gateway is done with the request (answered, failed, or cancelled): whatever replica still
        counts it, in flight or by reservation, stops counting it. The id is remembered for a while: Ray
        reports a request routed only after the replica accepted it, on the router's own event loop, and a
        short stream can be relayed whole and finished here before that report arrives; counted then, it
        would stay in flight for good. The gateway gives every attempt its own id, so a retry is never
        mistaken for the attempt that finished."""
        with self._lock:
            prediction = self._predictions.pop(request_id, None)
            for replica in [r for r, q in self._flights if q == request_id]:
                self.completed(replica, request_id)
            self._prefilled(request_id)
            now = self.clock()
            while self._finished_order and now - self._finished_order[0][0] > _FINISHED_KEPT_S:
                self._finished.discard(self._finished_order.popleft()[1])
            if request_id not in self._finished:
                self._finished.add(request_id)
                self._finished_order.append((now, request_id))
        if prediction is not None and cached_tokens is not None and prompt_tokens > 0:
            predicted = round(prediction[0] * prompt_tokens)
            try:  # the request's end goes on whatever the metrics say (its rollout sample is recorded after)
                metrics.prefix_prediction(self.model, self.version, prediction[1], predicted, cached_tokens)
            except Exception:  # noqa: BLE001
                log.warning("recording a prefix prediction failed", exc_info=True)

    def _prefilled(self, request_id: str) -> None:
        entry = self._prefill.pop(request_id, None)
        if entry is not None:
            replica, tokens = entry
            left = self.pending.get(replica, 0) - tokens
            if left > 0:
                self.pending[replica] = left
            else:
                self.pending.pop(replica, None)

    def record_outcome(self, replica: str, failed: bool, why: str = "") -> None:
        with self._lock:
            self.breakers.record(replica, failed, why)

    def unavailable_for_s(self) -> float | None:
        """Seconds until a replica may take requests again, when every known replica is blocked."""
        with self._lock:
            if not self.replicas:
                return None
            return self.breakers.all_open(self.replicas)

    def _breaker_changed(self, replica: str, before: BreakerState, after: BreakerState, why: str) -> None:
        level = log.warning if after is BreakerState.OPEN else log.info
        level("model %s replica %s: breaker %s -> %s (%s)", self.model, replica, before.value, after.value, why)
        metrics.breaker_state(self.model, self.version, replica, after.level, to=after.value)


class AdapterResidency:
    """Which LoRA adapters each replica's engine holds, least recently used first: the replica's own
    report (its routing stats, every `routing.stats_period_s`), and since that report, what this process
    sent there (the engine loads an adapter for the first request that names it, and evicts its least
    recently used past its capacity). The report also counts what other gateways sent."""

    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[str, None]] = {}
        self._capacity: dict[str, int] = {}
        self._slots: dict[str, int] = {}
        self._since_report: dict[str, list[str]] = {}

    def holds(self, replica: str, adapter: str) -> bool:
        return adapter in self._held.get(replica, ())

    def sent(self, replica: str, adapter: str) -> None:
        since = self._since_report.setdefault(replica, [])
        since.append(adapter)
        del since[:-_SENT_KEPT]  # bounded where a replica never reports (an engine without adapters)
        self._touch(replica, adapter)

    def slots(self, replica: str) -> int | None:
        """The adapters the replica's engine runs in one batch (`max_loras`), once it reported them."""
        return self._slots.get(replica)

    def reported(self, replica: str, held: Any, capacity: Any, slots: Any = None) -> None:
        if isinstance(capacity, int) and capacity > 0:
            self._capacity[replica] = capacity
        if isinstance(slots, int) and slots > 0:
            self._slots[replica] = slots
        self._held[replica] = OrderedDict((str(a), None) for a in held or ())
        for adapter in self._since_report.pop(replica, []):  # may not have reached the engine at the report
            self._touch(replica, adapter)

    def retain(self, replicas: set[str]) -> None:
        for table in (self._held, self._capacity, self._slots, self._since_report):
            for replica in [r for r in table if r not in replicas]:
                del table[replica]

    def _touch(self, replica: str, adapter: str) -> None:
        held = self._held.setdefault(replica, OrderedDict())
        held[adapter] = None
        held.move_to_end(adapter)
        capacity = self._capacity.get(replica)
        while capacity and len(held) > capacity:
            held.popitem(last=False)


# Predictions kept for requests in flight, at most (each is dropped when its request finishes).
_PREDICTIONS_KEPT = 10_000
# Precise replicas: keys sent there count as held this long past the replica's last report, which cannot
# show them before their prefill and the next stats poll (see PrefixIndex.reported).
SPECULATION_S = 10.0
# Ray sends a chosen request within milliseconds, or retries it after a full replica's rejection with a
# backoff of at most a few seconds; a reservation older than this belongs to a request that went away.
RESERVATION_TTL_S = 10.0
# Adapters sent to a replica since its last report, at most (reports come every couple of seconds).
_SENT_KEPT = 256
# Departures are remembered this long: far past any drain timeout, and bounded for long-lived gateways.
_DEPARTED_KEPT_S = 6 * 3600.0

_lock = threading.Lock()
_by_deployment: dict[str, DeploymentRouting] = {}


def deployment_key(app_name: str, deployment_name: str) -> str:
    return f"{app_name}#{deployment_name}"


def routing_state(key: str, model: str, policy: str, config: RoutingConfig,
                  block_size: int | None = None, version: str = DEFAULT_VERSION) -> DeploymentRouting:
    """The process's state for deployment `key`, created by whoever needs it first. The router passes
    the engine's KV block size; the gateway, which does not know it, passes None."""
    with _lock:
        state = _by_deployment.get(key)
        if state is None:
            state = _by_deployment[key] = DeploymentRouting(model, policy, config, block_size or 16,
                                                            version=version)
        elif block_size:
            state.block_size = block_size
        return state

