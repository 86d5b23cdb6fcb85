"""Graceful draining: a replica that leaves finishes what it holds, within a bound.

Ray Serve stops a replica (scale-down, update, version retirement, app shutdown, node drain) by taking
it out of every router's replica set, waiting while it still has requests in flight, and killing it
after `graceful_shutdown_timeout_s`. Ray's default (20 s) cuts LLM streams, and a kill cuts them
without a word. Shunter therefore:

- gives Ray a shutdown timeout of the model's drain timeout plus `RAY_KILL_MARGIN_S`, for the model
  replicas and for the gateway (which relays their streams to clients);
- starts its own drain clock in each gateway when the replica leaves that gateway's routing set; a
  stream still running at the drain timeout is ended by the gateway with a clear `replica_drain_timeout`
  error event and cancelled, which frees the replica to stop before Ray's kill could cut anything;
- measures, per gateway, how long each leaving replica took to finish the streams it relayed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shunter.ops import metrics

RAY_KILL_MARGIN_S = 30.0
# How often a leaving replica looks for ongoing requests (Ray's graceful_shutdown_wait_loop_s). Ray's
# default of 2 s is paid once per deployment even when the replica is idle, so an idle `serve run` took
# seconds per stage to stop on Ctrl-C; a count of local requests is cheap to poll.
SHUTDOWN_POLL_S = 0.25


def ray_shutdown_timeout_s(drain_timeout_s: float) -> float:
    """Ray's graceful_shutdown_timeout_s for a drain timeout: Ray's kill must come after the gateway's
    own abort, so a stream is never cut without an error event."""
    return drain_timeout_s + RAY_KILL_MARGIN_S


class DrainTracker:
    """One model's streams per replica in one gateway, to measure drains of replicas that left."""

    def __init__(self, model: str, clock: Callable[[], float] = time.monotonic):
        self.model = model
        self.clock = clock
        self.open: dict[str, int] = {}

    def opened(self, replica: str) -> None:
        self.open[replica] = self.open.get(replica, 0) + 1

    def closed(self, replica: str, departed_at: float | None, aborted: bool = False) -> float | None:
        """A relay from `replica` ended. When the replica had left and this was its last open stream
        here, the drain is over: returns (and records) how long it took."""
        left = self.open.get(replica, 0) - 1
        if left > 0:
            self.open[replica] = left
        else:
            self.open.pop(replica, None)
        if aborted:
            metrics.drain_aborted(self.model)
        if departed_at is None or left > 0:
            return None
        took = max(0.0, self.clock() - departed_at)
        metrics.drain_finished(self.model, took)
        return took
