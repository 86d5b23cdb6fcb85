"""`UsageLedger`: the Serve deployment that owns the usage ledger's SQLite file, on the Ray head node.

One replica, no CPU reserved, pinned to the head node (Ray's `node:__internal_head__` resource, the one Ray's
own head-only actors ask for), so the file stays on one node across restarts and a KubeRay head pod's
persistent volume holds it. Gateways send it batches of records (shunter.deployments.gateway.usage), and
/admin/usage and the Usage API ask it for sums; the SQLite calls run in a thread so a batch being written
never holds the replica's event loop. A replica restarted by Serve reopens the same file: nothing written is
lost, and a batch a gateway sends again (its reply lost in the restart) is counted once (the request id is the
key).

The store never raises for a full file (it holds the usage in memory: shunter.usage_ledger), so a full disk
never turns into every gateway resending its batches; this deployment exports that state, which the store,
pure Python, cannot: `shunter_usage_ledger_degraded` and `shunter_usage_ledger_held_records_total`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from ray import serve

from shunter.metric_catalog import build
from shunter.ray_metrics import LazyMetrics
from shunter.usage_ledger import LedgerStore, UsageRecord

log = logging.getLogger("ray.serve")

_NAMES = ("shunter_usage_ledger_degraded", "shunter_usage_ledger_held_records_total")
_record = LazyMetrics(lambda metrics: build(metrics, _NAMES)).record

HEAD_NODE_RESOURCE = "node:__internal_head__"  # every Ray head node has it (ray._common.constants)


def head_node_options(name: str, max_ongoing_requests: int) -> dict[str, Any]:
    """Serve options of a one-replica deployment that owns files on the head node and reserves no CPU."""
    return {"name": name, "num_replicas": 1,
            "ray_actor_options": {"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}},
            "max_ongoing_requests": max_ongoing_requests}


# Every gateway's flush and every /admin/usage call at once; each is short.
LEDGER_OPTIONS = head_node_options("usage_ledger", 256)


@serve.deployment
class UsageLedger:
    def __init__(self, path: str, retention_days: float | None = None, max_size_mb: float | None = None):
        """The config's usage.path (expanded here, on the head node), usage.retention_days, usage.max_size_mb."""
        self.store = LedgerStore(path, retention_days=retention_days, max_size_mb=max_size_mb)
        self._held_seen = 0
        log.info("usage ledger at %s: %d row(s); retention %s, size bound %s", self.store.path, self.store.count(),
                 "none" if retention_days is None else f"{retention_days:g} day(s)",
                 "the disk" if max_size_mb is None else f"{max_size_mb:g} MiB")
        self._report()

    async def record(self, records: list[dict[str, Any]]) -> int:
        """Add a gateway's batch (UsageRecord.to_dict each); returns how many rows were new or changed (a resent
        batch: 0)."""
        batch = [UsageRecord.from_dict(r) for r in records]
        try:
            return await asyncio.to_thread(self.store.write, batch)
        finally:
            self._report()

    async def query(self, key: str | None = None, model: str | None = None, since: float | None = None,
                    until: float | None = None, group_by: Sequence[str] = ("key", "model")) -> list[dict[str, Any]]:
        """Sums by `group_by` (shunter.usage_ledger.LedgerStore.query)."""
        return await asyncio.to_thread(self.store.query, key, model, since, until, tuple(group_by))

    async def buckets(self, since: float, until: float, width_s: int, group_by: Sequence[str] = (),
                      key: str | None = None, key_ids: Sequence[str] | None = None,
                      models: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Model usage per bucket (shunter.usage_ledger.LedgerStore.buckets), for the Usage API."""
        return await asyncio.to_thread(self.store.buckets, since, until, width_s, tuple(group_by), key,
                                       None if key_ids is None else list(key_ids),
                                       None if models is None else list(models))

    async def count(self) -> int:
        return await asyncio.to_thread(self.store.count)

    def _report(self) -> None:
        held, self._held_seen = self.store.held_total - self._held_seen, self.store.held_total
        degraded = 1.0 if self.store.degraded else 0.0

        def report(m: dict[str, Any]) -> None:
            m["shunter_usage_ledger_degraded"].set(degraded, tags={})
            if held:
                m["shunter_usage_ledger_held_records_total"].inc(held)

        _record(report)

    def __del__(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store.close()  # writes what it holds in memory first
