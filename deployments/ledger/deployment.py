"""`UsageLedger`: the Serve deployment that owns the usage ledger's SQLite file, on the Ray head node.

One replica, no CPU reserved, pinned to the head node (Ray's `node:__internal_head__` resource, the one Ray's
own head-only actors ask for), so the file stays on one node across restarts and a KubeRay head pod's
persistent volume holds it. Gateways send it batches of records (shunter.deployments.gateway.usage) and
/admin/usage asks it for sums; the SQLite calls run in a thread so a batch being written never holds the
replica's event loop. A replica restarted by Serve reopens the same file: nothing written is lost, and a
batch a gateway sends again (its reply lost in the restart) is counted once (the request id is the key).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from ray import serve

from shunter.usage_ledger import LedgerStore, UsageRecord

log = logging.getLogger("ray.serve")

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
    def __init__(self, path: str):
        """`path`: the config's usage.path, expanded here, on the head node."""
        self.store = LedgerStore(path)
        log.info("usage ledger at %s: %d record(s)", self.store.path, self.store.count())

    async def record(self, records: list[dict[str, Any]]) -> int:
        """Add a gateway's batch (UsageRecord.to_dict each); returns how many were new (a resent batch: 0)."""
        batch = [UsageRecord.from_dict(r) for r in records]
        return await asyncio.to_thread(self.store.write, batch)

    async def query(self, key: str | None = None, model: str | None = None, since: float | None = None,
                    until: float | None = None, group_by: Sequence[str] = ("key", "model")) -> list[dict[str, Any]]:
        """Sums by `group_by` (shunter.usage_ledger.LedgerStore.query)."""
        return await asyncio.to_thread(self.store.query, key, model, since, until, tuple(group_by))

    async def count(self) -> int:
        return await asyncio.to_thread(self.store.count)

    def __del__(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store.close()
