"""Warm standby replicas: engines started, weights loaded, routed nothing, until the model needs them.

A model with `standby_replicas: S` runs S replicas beyond what its load asks for. Scaling out (from zero
too) or losing a serving replica then costs a routing change, not an engine start: the standby is already
answering health checks, and Serve starts another standby in the background.

Who decides: the autoscaling policy (`shunter.ops.autoscaling`, in Serve's controller) asks Ray for the
replicas the load needs (`active`) plus S, and names which running replicas serve: the `active` of them
that it saw running first (a replica keeps its place; a new one joins as standby). It writes that set to
Ray's key-value store when it changes; every gateway reads it once a second with the control state and
hands it to its routers (`shunter.routing.routers`), which send new requests only to the named replicas
while one of them can take it, and to any running replica otherwise. So:

- scale-out: the policy names one more replica, a standby, at its next tick; the gateways route to it within
  about a second of the decision;
- a serving replica dies: if others serve, the policy names the standby in its place at once; if it was the
  last, the routers find no named replica running and use the standby immediately;
- from zero: no replica is named, so the first request goes to the standby at once (no engine start), and
  the policy names it as the load appears.

An entry is only an allow-list: it never refuses a request, and a stale one (the controller restarted, a
replica it names has gone) degrades to plain routing over every running replica.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from shunter.ops.backlog import KeyStore
from shunter.ops.control import RayStore


def _prefix(app: str) -> bytes:
    return f"serving/{app}/".encode()


def serving_set(running: Iterable[str], first_seen: dict[str, float], active: int,
                now: float) -> tuple[list[str], dict[str, float]]:
    """The `active` running replicas that serve (those seen running first; ties by id), and the first-seen
    times carried to the next call (replicas no longer running are dropped)."""
    running = list(running)
    seen = {r: first_seen.get(r, now) for r in running}
    order = sorted(running, key=lambda r: (seen[r], r))
    return sorted(order[:max(0, active)]), seen


def publish(app: str, deployment: str, serving: list[str], standby: list[str],
            store: KeyStore | None = None) -> None:
    """Write which replicas of `deployment` serve, and which stand by (a blocking store write)."""
    (store or RayStore()).put(_prefix(app) + deployment.encode(),
                              json.dumps({"serving": serving, "standby": standby}).encode())


def read(app: str, store: KeyStore | None = None) -> dict[str, dict[str, frozenset[str]]]:
    """deployment -> {"serving": ..., "standby": ...}, for the app's deployments that have standby replicas.
    A blocking call to the store: run it off an event loop."""
    store = store or RayStore()
    found: dict[str, dict[str, frozenset[str]]] = {}
    prefix = _prefix(app)
    for key in store.keys(prefix):
        raw = store.get(key)
        try:
            entry: dict[str, Any] = json.loads(raw) if raw else {}
            found[key[len(prefix):].decode()] = {part: frozenset(map(str, entry.get(part) or ()))
                                                 for part in ("serving", "standby")}
        except (ValueError, TypeError, AttributeError):  # a malformed entry: plain routing for it
            continue
    return found
