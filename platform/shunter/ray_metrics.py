"""Metrics through Ray's own exporter (`ray.util.metrics`), so a cluster's Prometheus scrapes Shunter's
series with Ray's; Ray prefixes every name with `ray_` on export.

Each area (routing, ops) declares its metrics in one builder function; they are created on first use
inside a Ray worker. Outside one (unit tests, the CLI) there is nothing to export to, and every
recording call is a no-op. Metrics must never break the path that records them.
"""

from __future__ import annotations

import logging
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
