"""The batch runner's metrics (names, labels and meaning: shunter.metric_catalog): per batch, the lines
finished (by outcome), still to run and running now. A dashboard row (shunter.ops.dashboards, the flow
dashboard) turns them into lines/s and an ETA per batch."""

from __future__ import annotations

from typing import Any

from shunter.metric_catalog import build
from shunter.ray_metrics import LazyMetrics

_NAMES = ("shunter_batch_lines_finished_total", "shunter_batch_lines_pending", "shunter_batch_lines_running")
_metrics = LazyMetrics(lambda metrics: build(metrics, _NAMES))


def finished(batch_id: str, key_id: str, ok: bool, lines: int = 1) -> None:
    def record(m: dict[str, Any]) -> None:
        m["shunter_batch_lines_finished_total"].inc(lines, tags={"batch": batch_id, "key_id": key_id,
                                                                   "outcome": "completed" if ok else "failed"})

    if lines:
        _metrics.record(record)


def progress(batch_id: str, key_id: str, pending: int, running: int) -> None:
    def record(m: dict[str, Any]) -> None:
        tags = {"batch": batch_id, "key_id": key_id}
        m["shunter_batch_lines_pending"].set(pending, tags=tags)
        m["shunter_batch_lines_running"].set(running, tags=tags)

    _metrics.record(record)


def ended(batch_id: str) -> None:
    def record(m: dict[str, Any]) -> None:
        m["shunter_batch_lines_pending"].clear(batch=batch_id)
        m["shunter_batch_lines_running"].clear(batch=batch_id)

    _metrics.record(record)
