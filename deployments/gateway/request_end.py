"""The one place a request ends: its single typed outcome, recorded once, and the hooks that act on it.

A request picks up obligations on its way through the gateway, recorded on its `RequestEnd`: an admission
slot in the model's gate (and its turn in the flow queue), the replica that answered (its work, the
routers' in-flight count, for a stream the replica's drain count and token-channel inbox), the version
outcome for rollouts. When it ends, `settle(outcome)` records the request's `Outcome` on its context, once,
and runs every registered hook on it, once, in order. The parts of the platform that care how a request
ended register a hook by name at the gateway's start (as llm-d's scheduler plugins register their
PostResponse hooks), rather than being called from each place a request can end:

- `replica`: cancel the replica's work unless it finished, close its inbox and drain count, and give the
  routers its in-flight slot back (with the cached tokens its usage reported);
- `breaker`: the answering replica's outcome for its circuit breaker (failures before the first byte are
  each attempt's own, recorded by shunter.deployments.gateway.replica_call as they happen);
- `rollout`: the version's (and an adapter version's) outcome, TTFT and latency for the rollout gates;
- `admission`: the dispatch turn and the admission slots;
- `telemetry`: metrics and spans;
- `quota`: the caller's reservation, settled on the tokens really used (a client that left: what the
  engine had produced, shunter.deployments.gateway.context.Usage.client_left);
- `usage`: one usage record of what the quota charged, for the ledger and the per-key usage metrics
  (shunter.deployments.gateway.usage);
- then the request's own `on_outcome` callbacks (the tier monitor's sampled comparison).

Where a request is settled: a whole reply when its response is built (or refused, or failed) in the
door's pipeline; a stream when its relay ends (done, broken, cut by a limit, drained, or the client gone).
A request the pipeline never settled (a stream whose response never started because the client left
first, so its relay never ran) is settled as the client gone by the gateway's ASGI guard
(`SettleUnsettled`), which wraps every request; nothing settles from a destructor. The endings are
enumerated in tests/unit/test_request_end.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from shunter.deployments.gateway.context import Ending, Outcome, RequestContext, client_gone, refused
from shunter.deployments.gateway.draining import DrainTracker
from shunter.deployments.gateway.flow.admission import AdmissionGate
from shunter.deployments.gateway.flow.queue import FairCharge, FlowQueue
from shunter.deployments.gateway.telemetry import RequestTelemetry
from shunter.deployments.gateway.traffic import LiveVersions
from shunter.deployments.gateway.usage import UsageWriter, record_usage
from shunter.errors import ApiError
from shunter.routing.state import DeploymentRouting

log = logging.getLogger("ray.serve")

STATE_KEY = "shunter_request_end"  # where the ASGI scope's state holds the request's RequestEnd


def cancel(stream: Any) -> None:
    """Cancel a replica response; a response that already failed may raise its error again here."""
    if stream is None:
        return
    try:
        stream.cancel()
    except Exception:  # noqa: BLE001 - nothing is left to cancel
        pass


@dataclass
class Reply:
    """The replica whose answer the client gets."""

    stream: Any
    replica: str
    routing_id: str
    routing: DeploymentRouting
    version: str
    began: float  # when the first attempt started (monotonic)
    first_byte_s: float  # from then to the reply's head (a stream: its first chunk)
    streamed: bool
    drains: DrainTracker | None = None  # streams only: counted open on the replica until they end
    on_release: Callable[[], None] | None = None  # closing the stream's token-channel inbox


Hook = Callable[["RequestEnd", Outcome], None]


class EndHooks:
    """The hooks a gateway runs on every request's outcome, registered by name, run in order."""

    def __init__(self) -> None:
        self._hooks: list[tuple[str, Hook]] = []

    def register(self, name: str, hook: Hook) -> None:
        if any(n == name for n, _ in self._hooks):
            raise ValueError(f"end-of-request hook {name!r} is registered twice")
        self._hooks.append((name, hook))

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self._hooks]

    def run(self, end: RequestEnd, outcome: Outcome) -> None:
        for name, hook in self._hooks:
            try:
                hook(end, outcome)
            except Exception:  # noqa: BLE001 - bookkeeping never breaks a request; the others still run
                log.warning("request %s: end-of-request hook %s failed", end.ctx.request_id, name, exc_info=True)


class RequestEnd:
    """One request's obligations and its single outcome; see the module docstring."""

    def __init__(self, ctx: RequestContext, tel: RequestTelemetry, hooks: EndHooks):
        self.ctx, self.tel, self.hooks = ctx, tel, hooks
        self.gate: AdmissionGate | None = None
        self.gate_weight, self.gate_rank, self.gate_tenant = 1, 0, None
        self.turn: FlowQueue | None = None  # the flow queue whose turn the request holds
        self.charge: FairCharge | None = None  # what its tenant's fair share was charged for it there
        self.reply: Reply | None = None

    @property
    def settled(self) -> bool:
        return self.ctx.outcome is not None

    def hold(self, gate: AdmissionGate, weight: int = 1, rank: int = 0, tenant: str | None = None) -> None:
        """The request took `weight` admission slots of `gate` (a batch takes one per engine request), for
        priority class `rank` and, where admitted by its tenant's fair part, `tenant`."""
        self.gate, self.gate_weight, self.gate_rank, self.gate_tenant = gate, weight, rank, tenant

    def dispatched(self, queue: FlowQueue, charge: FairCharge | None = None) -> None:
        """The request had its turn in `queue` and goes to the replicas; `charge`: what it cost its tenant's
        share there, corrected by what it used when it ends."""
        self.turn, self.charge = queue, charge

    def attach(self, reply: Reply) -> None:
        """The replica answered and its reply goes to the client (a stream: counted open for its drain)."""
        self.reply = reply
        if reply.drains is not None:
            reply.drains.opened(reply.replica)

    @contextmanager
    def settled_on_failure(self) -> Iterator[None]:
        """Around a request's pipeline: an exception that ends it settles it, as what the exception says
        (a refusal, the client gone, a bug), and goes on."""
        try:
            yield
        except ApiError as refusal:
            self.settle(refused(refusal.status))
            raise
        except asyncio.CancelledError:  # the client left while the request waited or ran
            self.settle(client_gone())
            raise
        except BaseException:
            self.settle(Outcome(Ending.GATEWAY_ERROR, 500, finished=False))
            raise

    def settle(self, outcome: Outcome) -> None:
        """The request is over: record its outcome and run every hook on it. Later calls do nothing."""
        if self.ctx.outcome is not None:
            return
        self.ctx.outcome = outcome
        if outcome.ending is Ending.CLIENT_GONE:
            self.ctx.usage.client_left()
        self.hooks.run(self, outcome)
        for callback in self.ctx.on_outcome:
            try:
                callback(self.ctx)
            except Exception:  # noqa: BLE001
                log.warning("request %s: an outcome callback failed", self.ctx.request_id, exc_info=True)


# ---- the platform's hooks ----------------------------------------------------------------------------


def release_replica(end: RequestEnd, outcome: Outcome) -> None:
    reply = end.reply
    if reply is None:
        return
    if not outcome.finished:  # the client left or the request was cancelled: stop the engine's work
        cancel(reply.stream)
    if reply.on_release is not None:
        reply.on_release()
    if reply.drains is not None:
        reply.drains.closed(reply.replica, reply.routing.departed_at(reply.replica),
                            outcome.ending is Ending.DRAINED)
    usage = end.ctx.usage
    reply.routing.finished(reply.routing_id, cached_tokens=usage.cached_tokens, prompt_tokens=usage.prompt_tokens)


def record_breaker(end: RequestEnd, outcome: Outcome) -> None:
    reply, failed = end.reply, outcome.replica_failed
    if reply is not None and failed is not None:
        reply.routing.record_outcome(reply.replica, failed, outcome.why if failed else "")


def release_admission(end: RequestEnd, outcome: Outcome) -> None:
    if end.charge is not None:
        end.charge.leave()
    elif end.turn is not None:
        end.turn.leave()
    if end.charge is not None:  # the tokens it really used, as the engine reported them (cut short: so far)
        usage = end.ctx.usage
        end.charge.refund(max(usage.prompt_tokens + usage.completion_tokens, sum(usage.in_engine)))
    if end.gate is not None:
        end.gate.release(end.gate_weight, end.gate_rank, end.gate_tenant)


def finish_telemetry(end: RequestEnd, outcome: Outcome) -> None:
    end.tel.finish(outcome.status)


def settle_quota(end: RequestEnd, outcome: Outcome) -> None:
    ticket, usage = end.ctx.ticket, end.ctx.usage
    if ticket is not None:  # a request that never had its turn for a replica reached no engine
        ticket.settle(str(outcome.status), usage.prompt_tokens, usage.completion_tokens,
                      reached_engine=end.turn is not None or end.reply is not None)


def rollout_hook(traffic: LiveVersions) -> Hook:
    """The version's outcome for the rollout gates (of the model's versions, and of its LoRA adapter's): a
    whole reply's first byte is its latency (a client error says nothing about the version), a stream's
    first chunk its TTFT and its end-to-end time is timed here."""

    def hook(end: RequestEnd, outcome: Outcome) -> None:
        reply, ok, ctx = end.reply, outcome.version_ok, end.ctx
        if reply is None or ok is None:
            return
        if reply.streamed:
            traffic.record_request(ctx.model, ctx.adapter, reply.version, ok, reply.first_byte_s,
                                   time.monotonic() - reply.began)
        elif isinstance(outcome.status, int) and outcome.status < 400:
            traffic.record_request(ctx.model, ctx.adapter, reply.version, ok, None, reply.first_byte_s)

    return hook


def standard_hooks(traffic: LiveVersions, usage: UsageWriter | None = None) -> EndHooks:
    """Every gateway's hooks, in the order they must run: the replica first (the routers read the usage
    the reply reported), the quota after a client that left was charged what the engine produced, and the
    usage record last, with what the quota charged (`usage`: the gateway's ledger writer; None: metrics
    only)."""
    hooks = EndHooks()
    hooks.register("replica", release_replica)
    hooks.register("breaker", record_breaker)
    hooks.register("rollout", rollout_hook(traffic))
    hooks.register("admission", release_admission)
    hooks.register("telemetry", finish_telemetry)
    hooks.register("quota", settle_quota)
    hooks.register("usage", record_usage(usage))
    return hooks


class SettleUnsettled:
    """ASGI middleware around the gateway's app: a request whose pipeline never settled it by the time its
    ASGI call ends, however it ends (a stream whose response never started: the client left before its
    relay ran), is settled as the client gone. The pipeline stores its RequestEnd in the scope's state."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            end = scope.get("state", {}).get(STATE_KEY)
            if end is not None and not end.settled:
                end.settle(client_gone())
