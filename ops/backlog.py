"""The gateways' backlog, for the autoscaling policy: admitted requests waiting in a gateway's dispatch
queue (`shunter.deployments.gateway.flow.queue.FlowQueue`) are work no replica holds yet, and Ray's handle-side
queue (which the policy also counts) no longer sees them, because the gateway keeps them out of Ray's
router until a slot frees.

With priority classes, each gateway also reports per model its admitted requests of the batch classes
(those less urgent than the default class), waiting or running: the policy scales for them only up to the
model's `batch_max_replicas`.

Each gateway replica writes its depths per model under its own key in Ray's key-value store (the store
the control state lives in), when they change and, while non-zero, at least every `REFRESH_S`; the
policy sums the fresh entries of its model. An entry older than `STALE_S` (a gateway gone) counts for
nothing.
"""

from __future__ import annotations

import json
import time
from typing import NamedTuple, Protocol

from shunter.ops.control import RayStore

REFRESH_S = 2.0
STALE_S = 6.0


class KeyStore(Protocol):
    def get(self, key: bytes) -> bytes | None: ...

    def put(self, key: bytes, value: bytes) -> None: ...

    def keys(self, prefix: bytes) -> list[bytes]: ...


class Backlog(NamedTuple):
    waiting: int  # admitted requests waiting in the gateways for a replica slot
    batch: int  # admitted requests of the batch classes, waiting or running


def _prefix(app: str) -> bytes:
    return f"backlog/{app}/".encode()


class BacklogReporter:
    """One gateway replica's writer. `report` is a blocking call: run it off the event loop."""

    def __init__(self, app: str, gateway: str, store: KeyStore | None = None,
                 clock=time.time):  # noqa: ANN001 - a clock
        self.key = _prefix(app) + gateway.encode()
        self.store = store or RayStore()
        self.clock = clock
        self._last: tuple[float, dict[str, int], dict[str, int]] | None = None

    def report(self, depths: dict[str, int], batch: dict[str, int] | None = None) -> bool:
        """Write `depths` (model -> requests waiting) and `batch` (model -> batch-class requests waiting or
        running) if they changed, or if non-zero and the last write is getting old. Returns whether it
        wrote."""
        now, batch = self.clock(), batch or {}
        if self._last is not None:
            at, last, last_batch = self._last
            busy = any(depths.values()) or any(batch.values())
            if last == depths and last_batch == batch and (not busy or now - at < REFRESH_S):
                return False
        self.store.put(self.key, json.dumps({"at": now, "depths": depths, "batch": batch}).encode())
        self._last = (now, dict(depths), dict(batch))
        return True


def backlog(app: str, model: str, store: KeyStore | None = None, now: float | None = None) -> Backlog:
    """Requests of `model` waiting in the app's gateways, and its batch-class requests, as fresh reports
    say. Blocking."""
    store = store or RayStore()
    now = time.time() if now is None else now
    waiting = batch = 0
    for key in store.keys(_prefix(app)):
        raw = store.get(key)
        try:
            entry = json.loads(raw) if raw else {}
            if now - float(entry.get("at", 0)) <= STALE_S:
                waiting += int(entry.get("depths", {}).get(model, 0))
                batch += int(entry.get("batch", {}).get(model, 0))
        except (ValueError, TypeError, AttributeError):
            continue  # a torn or foreign entry counts for nothing
    return Backlog(waiting, batch)
