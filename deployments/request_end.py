"""The one place a request ends: everything that must happen exactly once, however it ends.

A request picks up obligations on its way through the gateway: the caller's quota reservation (settled
on the tokens really used), telemetry (its status, latencies and spans), an admission slot in the model's
gate, the routers' in-flight count on the replica that answered (and, for a stream, the replica's drain
count), the version's outcome for rollouts, and the replica's work itself (cancelled unless it finished).
`RequestEnd` collects them as they are taken and `settle()` discharges them all, once, with the status
the client saw. Whole replies settle when their response is built; streams when the relay ends (done,
broken, cut by a limit, drained, or the client gone); a request cancelled or failing anywhere in between
settles in the door's `finally`; a stream whose response never started (the client left first, so the
relay never ran) settles when it is dropped. The endings are enumerated in tests/unit/test_request_end.py.

A client that leaves (499): its replica's work is cancelled (vLLM aborts the engine requests at once), its
slot and admission place are given back, and its quota is settled at what the engine had produced: a
stream at the running usage of its last chunk, a whole reply at its replica's last `Working` heartbeat
(shunter.engine_usage counts it on the replica, at most a second behind), or, when the engine had reported
nothing yet, the prompt's estimate (shunter.deployments.access.Ticket).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shunter.deployments.telemetry import STREAM_ERROR, RequestTelemetry
from shunter.ops.admission import AdmissionGate, DispatchQueue
from shunter.ops.draining import DrainTracker
from shunter.routing.state import DeploymentRouting

log = logging.getLogger("ray.serve")

CLIENT_GONE = 499  # the client closed the connection first (nginx's name for it)


def cancel(stream: Any) -> None:
    """Cancel a replica response; a response that already failed may raise its error again here."""
    if stream is None:
        return
    try:
        stream.cancel()
    except Exception:  # noqa: BLE001 - nothing is left to cancel
        pass


@dataclass
class _Reply:
    """The replica whose answer the client gets."""

    stream: Any
    replica: str
    routing_id: str
    routing: DeploymentRouting
    drains: DrainTracker | None  # streams only: counted open on the replica until they end
    outcome: Callable[[bool], None] | None  # the version's outcome, for rollouts' gates
    on_release: Callable[[], None] | None = None  # e.g. closing the stream's token-channel inbox


class RequestEnd:
    """One request's obligations, discharged once by `settle`; see the module docstring."""

    def __init__(self, tel: RequestTelemetry):
        self.tel = tel
        self.ticket: Any = None  # the caller's quota reservation (shunter.deployments.access.Ticket)
        self.gate: AdmissionGate | None = None
        self.gate_weight = 1
        self.turn: DispatchQueue | None = None  # the dispatch queue whose turn the request holds
        self.reply: _Reply | None = None
        self.settled = False

    def reserve(self, ticket: Any) -> None:
        self.ticket = ticket

    def hold(self, gate: AdmissionGate, weight: int = 1) -> None:
        """The request took `weight` admission slots of `gate` (a batch takes one per engine request)."""
        self.gate, self.gate_weight = gate, weight

    def dispatched(self, queue: DispatchQueue) -> None:
        """The request had its turn in `queue` and goes to the replicas."""
        self.turn = queue

    def attach(self, stream: Any, replica: str, routing_id: str, routing: DeploymentRouting,
               drains: DrainTracker | None = None, outcome: Callable[[bool], None] | None = None,
               on_release: Callable[[], None] | None = None) -> None:
        """The replica answered and its reply goes to the client (a stream: counted open for its drain)."""
        self.reply = _Reply(stream, replica, routing_id, routing, drains, outcome, on_release)
        if drains is not None:
            drains.opened(replica)

    def settle(self, status: int | str, *, finished: bool = True, ok: bool | None = None,
               aborted: bool = False) -> None:
        """The request is over and the client saw `status`. `finished`: the replica's work ended by
        itself (else it is cancelled). `ok`: served whole (True) or broken (False), for the version's
        outcome; None when the ending says nothing about the version (a client error, the client gone, a
        limit). `aborted`: a drain timeout cut the stream. Later calls do nothing."""
        if self.settled:
            return
        self.settled = True
        if str(status) == str(CLIENT_GONE):
            self.tel.client_left()  # charged what the engine had produced, never the whole reservation
        for step, action in (("replica", lambda: self._release_replica(finished, ok, aborted)),
                             ("admission", self._release_admission)):
            try:
                action()
            except Exception:  # noqa: BLE001 - bookkeeping never breaks a request; the others still run
                log.warning("request %s: settling its %s failed", self.tel.request_id, step, exc_info=True)
        self.tel.finish(status)  # metrics, spans, and the tier's callbacks; never raises
        if self.ticket is not None:
            try:
                self.ticket.settle(str(status), self.tel.prompt_tokens, self.tel.completion_tokens)
            except Exception:  # noqa: BLE001
                log.warning("request %s: settling its quota failed", self.tel.request_id, exc_info=True)

    def _release_admission(self) -> None:
        if self.turn is not None:
            self.turn.leave()
        if self.gate is not None:
            self.gate.release(self.gate_weight)

    def stream_status(self, ok: bool | None, aborted: bool, cut: bool) -> int | str:
        """The status a stream that started with 200 ends with: 200 served whole, `stream_error` when
        it broke, was drained or cut by a limit, 499 when the client left."""
        if ok:
            return 200
        return STREAM_ERROR if (ok is False or aborted or cut) else CLIENT_GONE

    def _release_replica(self, finished: bool, ok: bool | None, aborted: bool) -> None:
        reply = self.reply
        if reply is None:
            return
        if not finished:  # the client left or the request was cancelled: stop the engine's work
            cancel(reply.stream)
        if reply.on_release is not None:
            reply.on_release()
        if reply.drains is not None:
            reply.drains.closed(reply.replica, reply.routing.departed_at(reply.replica), aborted)
        reply.routing.finished(reply.routing_id, cached_tokens=self.tel.cached_tokens,
                               prompt_tokens=self.tel.prompt_tokens)
        if ok is not None and reply.outcome is not None:
            reply.outcome(ok)

    def __del__(self) -> None:
        # A streaming response dropped before it started: its relay (and so its settle) never ran.
        if not self.settled:
            self.settle(CLIENT_GONE, finished=False)
