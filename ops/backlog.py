"""The gateways' backlog, for the autoscaling policy: admitted requests waiting in a gateway's dispatch
queue (`shunter.deployments.gateway.flow_queue.FlowQueue`) are work no replica holds yet, and Ray's handle-side
queue (which the policy also counts) no longer sees them, because the gateway keeps them out of Ray's
router until a slot frees.

Each gateway replica writes its depths per model under its own key in Ray's key-value store (the store
the control state lives in), when they change and, while non-zero, at least every `REFRESH_S`; the
policy sums the fresh entries of its model. An entry older than `STALE_S` (a gateway gone) counts for
nothing.
"""

from __future__ import annotations

import json
import time
from typing import Protocol

from shunter.ops.control import RayStore

REFRESH_S = 2.0
STALE_S = 6.0


class KeyStore(Protocol):
    def get(self, key: bytes) -> bytes | None: ...

    def put(self, key: bytes, value: bytes) -> None: ...

    def keys(self, prefix: bytes) -> list[bytes]: ...


def _prefix(app: str) -> bytes:
    return f"backlog/{app}/".encode()


class BacklogReporter:
    """One gateway replica's writer. `report` is a blocking call: run it off the event loop."""

    def __init__(self, app: str, gateway: str, store: KeyStore | None = None,
                 clock=time.time):  # noqa: ANN001 - a clock
        self.key = _prefix(app) + gateway.encode()
        self.store = store or RayStore()
        self.clock = clock
        self._last: tuple[float, dict[str, int]] | None = None

    def report(self, depths: dict[str, int]) -> bool:
        """Write `depths` (model -> requests waiting) if they changed, or if non-zero and the last write
        is getting old. Returns whether it wrote."""
        now = self.clock()
        if self._last is not None:
            at, last = self._last
            if last == depths and (not any(depths.values()) or now - at < REFRESH_S):
                return False
        self.store.put(self.key, json.dumps({"at": now, "depths": depths}).encode())
        self._last = (now, dict(depths))
        return True


def backlog(app: str, model: str, store: KeyStore | None = None, now: float | None = None) -> int:
    """Requests of `model` waiting in the app's gateways, as fresh reports say. Blocking."""
    store = store or RayStore()
    now = time.time() if now is None else now
    total = 0
    for key in store.keys(_prefix(app)):
        raw = store.get(key)
        try:
            entry = json.loads(raw) if raw else {}
            if now - float(entry.get("at", 0)) <= STALE_S:
                total += int(entry.get("depths", {}).get(model, 0))
        except (ValueError, TypeError, AttributeError):
            continue  # a torn or foreign entry counts for nothing
    return total
