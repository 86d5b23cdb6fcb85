"""Metrics through Ray's own exporter (`ray.util.metrics`), so a cluster's Prometheus scrapes Shunter's
series with Ray's; Ray prefixes every name with `ray_` on export.

Each area (routing, ops) declares its metrics in one builder function; they are created on first use
inside a Ray worker. Outside one (unit tests, the CLI) there is nothing to export to, and every
recording call is a no-op. Metrics must never break the path that records them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ray.serve")


class LazyMetrics:
    def __init__(self, build: Callable[[Any], dict[str, Any]]):
        """`build(ray.util.metrics)` returns the area's metric objects by short name."""
        self._build = build
        self._metrics: dict[str, Any] | None = None

    def get(self) -> dict[str, Any] | None:
        if self._metrics is not None:
            return self._metrics
        try:
            import ray
            from ray.util import metrics

            if not ray.is_initialized():
                return None
            self._metrics = self._build(metrics)
        except Exception:  # noqa: BLE001 - metrics must never break the caller
            log.debug("metrics unavailable", exc_info=True)
            return None
        return self._metrics

    def record(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call `fn(metrics)` when metrics are available; a failure is logged, never raised (metrics
        never break a request)."""
        try:
            metrics = self.get()
            if metrics:
                fn(metrics)
        except Exception:  # noqa: BLE001 - metrics must never break the caller
            log.debug("metrics recording failed", exc_info=True)


class StickyGauge:
    """A Ray gauge that keeps reporting its last values, published off the request path.

    Ray 2.60's metrics agent drops a gauge series it has not heard of for two export intervals, and a
    worker exports only the values set since its last export. A gauge set once (a breaker opened, a
    weight changed) therefore vanished from Prometheus within seconds. Every StickyGauge of a process
    is re-set from one daemon thread every REFRESH_S, so its series lives as long as the process, until
    `clear` drops it (a replica that left).

    `set` only notes the value: the same thread hands the values set since its last turn to Ray every
    FLUSH_S. Only the value at Ray's export counts (every few seconds), and a gauge the request path sets
    at every change (requests queued, in flight) cost a Ray record per event: in a 256-stream burst, 3%
    of the gateway's CPU.
    """

    FLUSH_S = 1.0
    REFRESH_S = 4.0
    _all: list[StickyGauge] = []
    _lock = threading.Lock()
    _refresher: threading.Thread | None = None

    def __init__(self, gauge: Any):
        self._gauge = gauge
        self._values: dict[tuple[tuple[str, str], ...], float] = {}
        self._changed: set[tuple[tuple[str, str], ...]] = set()
        with StickyGauge._lock:
            StickyGauge._all.append(self)
            if StickyGauge._refresher is None:
                StickyGauge._refresher = threading.Thread(target=StickyGauge._refresh_forever, daemon=True,
                                                          name="shunter-gauges")
                StickyGauge._refresher.start()

    def set(self, value: float, tags: dict[str, str]) -> None:
        key = tuple(sorted(tags.items()))
        with StickyGauge._lock:
            self._values[key] = value
            self._changed.add(key)

    def clear(self, **match: str) -> None:
        """Stop reporting every series whose labels include `match`."""
        with StickyGauge._lock:
            for key in [k for k in self._values if set(match.items()) <= set(k)]:
                del self._values[key]
                self._changed.discard(key)

    @staticmethod
    def publish(everything: bool) -> None:
        """Hand Ray the values set since the last turn, or `everything` held."""
        with StickyGauge._lock:
            pending = [(g._gauge, dict(k), g._values[k]) for g in StickyGauge._all
                       for k in (g._values if everything else g._changed)]
            for g in StickyGauge._all:
                g._changed.clear()
        for gauge, tags, value in pending:
            try:
                gauge.set(value, tags=tags)
            except Exception:  # noqa: BLE001 - metrics must never break anything
                log.debug("gauge refresh failed", exc_info=True)

    @staticmethod
    def _refresh_forever() -> None:
        turns = 0
        every = max(1, round(StickyGauge.REFRESH_S / StickyGauge.FLUSH_S))
        while True:
            time.sleep(StickyGauge.FLUSH_S)
            turns += 1
            StickyGauge.publish(everything=turns % every == 0)
