"""Sending a request to one version of a model: pick a replica (Ray's request router, ours), wait for
it to take the request and answer its first byte, fail over once to another replica when it fails
before that byte, and turn every way of not starting into the client's response.

The replica protocol (`shunter.replica_protocol`): the replica answers `Accepted` as soon as it takes
the request, then the reply head (status, body or stream), then, for a stream, SSE chunks; `Working`
items keep a long prefill from looking like silence and say what a whole reply has produced so far (the
request's telemetry keeps the latest: a client that leaves is charged that). Waiting for each item is
bounded: by `gateway.queue_timeout_s` (or a scaled-to-zero model's cold start) for `Accepted`, by the
model's `routing.replica_timeout_s` of silence, by the drain timeout once the replica has left, and by the
request's own deadline and idle limit.

A client that leaves while its whole reply is computed: Serve's HTTP server sees the connection close
(`http.disconnect`) and cancels the route's task (shunter.ingress: HAProxy must pass the close on); the
cancellation reaches the wait here, which cancels the replica's call, and the replica cancels its work,
whose engine requests vLLM aborts. The request then settles as 499 (shunter.deployments.gateway.request_end).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from shunter.config import ModelConfig
from shunter.deployments.gateway.api_app import RETRY_AFTER_S
from shunter.deployments.gateway.context import RequestContext
from shunter.deployments.gateway.replica_stream import DrainTimeout, next_item
from shunter.deployments.gateway.request_end import cancel
from shunter.deployments.gateway.serving_state import ServingState, all_replicas_out
from shunter.deployments.gateway.telemetry import RequestTelemetry
from shunter.deployments.token_channel import GatewayChannels
from shunter.errors import ApiError
from shunter.ops import metrics as ops_metrics
from shunter.replica_protocol import Accepted, ReplicaRequest, ReplyHead
from shunter.routing.failover import ReplicaFailure, with_failover
from shunter.routing.state import DeploymentRouting

log = logging.getLogger("ray.serve")


@dataclass
class Started:
    """A reply whose replica has answered: its head, and for a stream the first chunk already read."""

    replica: str
    head: ReplyHead
    stream: Any
    first_chunk: Any  # a StreamChunk (or the StreamEnd of a stream with no chunk), or None
    routing_id: str  # this attempt's id in the routing state (each attempt has its own)
    inbox: asyncio.Queue | None = None  # the stream's chunks once it moves to the token channel
    channels: GatewayChannels | None = None

    def close_inbox(self) -> None:
        if self.channels is not None:
            self.channels.close(self.routing_id)


class QueueTimeout(Exception):
    """No replica took the request within gateway.queue_timeout_s (or, for a model scaled to zero, within
    autoscaling.cold_start_timeout_s)."""

    def __init__(self, waited_s: float, cold_start: bool):
        super().__init__(waited_s, cold_start)
        self.waited_s = waited_s
        self.cold_start = cold_start


class AllReplicasOut(Exception):
    """Every replica's breaker is open: nothing to send to, or to retry on."""


class NoReplica(Exception):
    """The request failed before any replica took it (none running, deployment failed)."""


class VersionFailed(Exception):
    """The request could not start on one version (before any byte reached the client); carries the
    refusal the client gets if no other version can take it."""

    def __init__(self, refusal: ApiError):
        super().__init__(refusal.status)
        self.refusal = refusal


class ReplicaCalls:
    def __init__(self, state: ServingState, queue_timeout_s: float, channels: GatewayChannels | None):
        self.state, self.queue_timeout_s, self.channels = state, queue_timeout_s, channels

    async def start(self, ctx: RequestContext, tel: RequestTelemetry, version: str,
                    routing: DeploymentRouting) -> Started:
        """Start the request on one version, failing over once between its replicas. Raises VersionFailed
        with the client's refusal when the version cannot serve it."""
        model = ctx.model

        def failed(failure: ReplicaFailure) -> None:
            log.warning("model %s request %s: replica %s failed before the first byte: %s", model.name,
                        ctx.request_id, failure.replica, failure.why)
            routing.record_outcome(failure.replica, True, failure.why)

        async def attempt(avoid: tuple[str, ...]) -> Started:
            if avoid and routing.unavailable_for_s() is not None:
                raise AllReplicasOut()  # the failure just recorded opened the last breaker
            ctx.version = version
            ctx.usage.new_attempt()
            carrier = tel.routing(version, attempt=len(avoid) + 1)
            routing_id = f"{ctx.routing_id}.{len(avoid) + 1}"
            try:
                return await self._attempt(ctx, tel, routing,
                                           ReplicaRequest(request_id=routing_id, avoid=avoid,
                                                          endpoint=ctx.endpoint.name, body=ctx.engine_body,
                                                          trace=carrier, limits=ctx.limits,
                                                          channel=self.channels.id if self.channels else None,
                                                          adapter=ctx.adapter))
            except BaseException as exc:
                tel.attempt_failed(type(exc).__name__)
                routing.finished(routing_id)  # Ray does not always report a failed or cancelled call
                raise
            finally:
                routing.first_byte(routing_id)  # answered or failed: its prefill no longer queues anywhere

        try:
            return await with_failover(attempt, model.routing.retry_once, failed)
        except QueueTimeout as timeout:
            raise VersionFailed(not_taken(model, timeout.waited_s, timeout.cold_start)) from None
        except AllReplicasOut:
            raise VersionFailed(all_replicas_out(model, routing)) from None
        except (ReplicaFailure, NoReplica) as exc:
            if isinstance(exc, NoReplica):
                log.warning("model %s: request failed before any replica took it: %r", model.name, exc.__cause__)
            ops_metrics.rejection(model.name, "model_unavailable")
            raise VersionFailed(ApiError(
                503, f"model {model.name!r} has no replica able to serve right now; retry shortly",
                code="model_unavailable", headers={"Retry-After": RETRY_AFTER_S})) from None

    async def _attempt(self, ctx: RequestContext, tel: RequestTelemetry, routing: DeploymentRouting,
                       request: ReplicaRequest) -> Started:
        """Send once and wait for the replica's first answer: the reply head, and for a stream its first
        chunk too, so a replica that fails before any byte reaches the client can be failed over."""
        stream, model, version = None, ctx.model, ctx.version
        channels = self.channels
        inbox = channels.open(request.request_id) if channels is not None else None
        try:
            stream = self.state.servers[model.name][version].options(stream=True).handle.remote(request)
            # A replica answers Accepted as soon as it takes the request; waiting for that is bounded, so
            # a model whose replicas cannot take work (none started, all full) is a 503, never a hang.
            cold_start = self.state.scaled_to_zero(model, routing)
            wait = self.queue_timeout_s
            if cold_start and model.autoscaling is not None:
                wait = model.autoscaling.cold_start_timeout_s
            try:
                accepted = await asyncio.wait_for(stream.__anext__(), wait)
            except TimeoutError:
                raise QueueTimeout(wait, cold_start) from None
            except Exception as exc:  # noqa: BLE001 - no replica, replica gone before taking it
                raise NoReplica() from exc
            if not isinstance(accepted, Accepted):
                raise NoReplica() from RuntimeError(f"replica protocol: expected Accepted, got {accepted!r}")
            replica, timeout = accepted.replica_id, model.routing.replica_timeout_s
            tel.accepted(replica)
            if accepted.load is not None:  # flow control counts in what the engine really runs
                self.state.engine_reported(model, replica, accepted.load)
            if channels is not None:
                channels.connect(accepted.channel)
            try:
                head = await next_item(stream, model, routing, replica, on_working=ctx.usage.working)
                first = None
                if head.stream:
                    try:
                        first = await next_item(stream, model, routing, replica)
                    except StopAsyncIteration:
                        first = None
            except TimeoutError:
                raise ReplicaFailure(replica, f"sent nothing for {timeout:g}s (hung?)") from None
            except DrainTimeout:
                raise ReplicaFailure(replica, f"left and had not answered within the drain timeout of "
                                     f"{model.draining.timeout_s:g}s") from None
            except Exception as exc:  # noqa: BLE001 - replica died, engine raised: the replica's fault
                raise ReplicaFailure(replica, f"{type(exc).__name__}: {exc}"[:300]) from None
            if head.status >= 500:
                raise ReplicaFailure(replica, f"engine answered {head.status}: {head.error_message}"[:300])
            if not head.stream and channels is not None:
                channels.close(request.request_id)
                inbox = None
            return Started(replica, head, stream, first, request.request_id, inbox, channels)
        except BaseException:
            cancel(stream)
            if channels is not None:
                channels.close(request.request_id)
            raise


def not_taken(model: ModelConfig, waited_s: float, cold_start: bool, retry_after_s: int | None = None) -> ApiError:
    """The 503 for a request no replica took within its wait (the gateway's flow queue, or Ray's);
    `retry_after_s`: when to retry, from the measured drain rate, where known."""
    if cold_start:
        ops_metrics.rejection(model.name, "cold_start_timeout")
        log.warning("model %s: no replica started within %ss of a request to the scaled-to-zero model",
                    model.name, waited_s)
        return ApiError(503, f"model {model.name!r} is scaled to zero and no replica started within "
                        f"{waited_s:g}s; retry shortly", code="cold_start_timeout",
                        headers={"Retry-After": RETRY_AFTER_S})
    ops_metrics.rejection(model.name, "queue_timeout")
    log.warning("model %s: no replica accepted a request within %ss", model.name, waited_s)
    retry = RETRY_AFTER_S if retry_after_s is None else str(retry_after_s)
    return ApiError(503, f"no replica of model {model.name!r} could take the request within {waited_s:g}s; "
                    "retry shortly", code="queue_timeout", headers={"Retry-After": retry})
