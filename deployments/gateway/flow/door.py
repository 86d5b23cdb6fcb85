"""`FlowControl`: the request path's three calls into flow control (see the package docstring).

- `class_of` and `engine_priority` at the door: the request's priority class, and the scheduling priority
  the engine gets for it where it schedules by priority;
- `refuse_if_full` before the body is parsed: a full model's refusal costs no parsing (`RefusedUnparsed`);
- `admit` once the key's quota is taken: the model's gate (429 past the class's bound or the tenant's fair
  part of it, or past the class's wait budget), then the flow queue (503 when its turn does not come in
  time). On return the request holds its admission and its turn on its `RequestEnd`, which gives both
  back however it ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import Request

from shunter.auth import Caller
from shunter.config import ModelConfig, ShunterConfig
from shunter.deployments.gateway.flow.admission import Asker
from shunter.deployments.gateway.flow.priority import PriorityClasses
from shunter.deployments.gateway.flow.queue import FlowQueue
from shunter.deployments.gateway.replica_call import not_taken
from shunter.deployments.gateway.request_end import RequestEnd
from shunter.deployments.gateway.serving_state import ServingState
from shunter.endpoints import Endpoint, ParsedRequest
from shunter.errors import ApiError
from shunter.ops import metrics as ops_metrics

RetryKey = tuple[str, bytes]


class RefusedUnparsed(Exception):
    """The door refused a full model's request before parsing its body (`FlowControl.refuse_if_full`):
    the class it would have had, and the 429."""

    def __init__(self, priority_class: str, refusal: ApiError):
        super().__init__(refusal.message)
        self.priority_class, self.refusal = priority_class, refusal


class FlowControl:
    def __init__(self, config: ShunterConfig, state: ServingState):
        self.config, self.state = config, state
        self.classes = PriorityClasses(config.flow_control)

    # ---- at the door ---------------------------------------------------------------------------------

    def class_of(self, caller: Caller, parsed: ParsedRequest, headers: Mapping[str, str], batch: bool = False) -> str:
        """The request's class (`batch`: a batch's line, always the least urgent); ApiError 400 or 403."""
        return self.classes.for_batch(parsed) if batch else self.classes.resolve(caller, parsed, headers)

    def engine_priority(self, model: ModelConfig, priority_class: str) -> int | None:
        """The scheduling priority its engine gets for the class: its rank (0, the most urgent) where the
        engine schedules by priority, else none."""
        return self.config.flow_control.rank(priority_class) if model.engine.scheduling_policy == "priority" else None

    def refuse_if_full(self, request: Request, endpoint: Endpoint, caller: Caller, name: str,
                       body: dict[str, Any], retry_key: RetryKey | None) -> None:
        """Refuse (RefusedUnparsed) a request whose model's gate would turn away even the lightest request of
        the class it will have, before its body is parsed and its prompt rendered: in a burst the refusals
        are the many, and each must reach its client at once, not after every admitted request's parsing.
        `admit` decides the same way later for what is not plain here (an adapter, `model: auto`, a class
        only the parsed request tells), and a key never learns anything of a model it may not use. Refused
        here, a request has nothing to give back: its quota was never reserved."""
        model = self.config.find_model(name)
        if model is None or not caller.may_use(model.name):
            return
        priority_class = self.classes.early(caller, endpoint, body, request.headers)
        if priority_class is None:
            return
        gate, rank = self.state.gate(model), self.config.flow_control.rank(priority_class)
        asker, needed = _asker(caller, self.state.dispatch(model), rank)
        capacity, max_wait = self.state.capacity(model), self._max_wait(model, priority_class)
        if not gate.refuses(capacity, max_wait, 1, rank, needed, retry_key, asker):
            return
        retry_after = gate.try_admit(capacity, max_wait, 1, rank, needed, retry_key, asker)
        assert retry_after is not None  # nothing ran in between: the same verdict
        raise RefusedUnparsed(priority_class, self._queue_full(model, priority_class, rank, retry_after))

    # ---- once the quota is taken ----------------------------------------------------------------------

    async def admit(self, end: RequestEnd, retry_key: RetryKey | None) -> None:
        """The model's gate, then its flow queue: returns once the request may go to the replicas (of
        `end.ctx.version`), holding its admission and its turn on `end`; ApiError 429 (refused, with its
        Retry-After) or 503 (no turn within its class's deadline, or a cold start's)."""
        ctx, tel = end.ctx, end.tel
        model = ctx.model
        gate, queue = self.state.gate(model), self.state.dispatch(model)
        capacity = self.state.capacity(model)
        rank = self.config.flow_control.rank(ctx.priority_class)
        # A batch (embedding inputs, completion prompts, choices) is that many engine requests' worth of work.
        weight = gate.admitted_weight(capacity, ctx.parsed.engine_requests)
        asker, needed = _asker(ctx.caller, queue, rank)
        retry_after = gate.try_admit(capacity, self._max_wait(model, ctx.priority_class), weight, rank, needed,
                                     retry_key, asker)
        if retry_after is not None:
            tel.refused("queue_full")
            raise self._queue_full(model, ctx.priority_class, rank, retry_after)
        end.hold(gate, weight, rank, asker.tenant)
        tel.admitted()
        wait = self.config.flow_control.max_wait_s(ctx.priority_class, self.config.gateway.queue_timeout_s,
                                                   self.config.gateway.limits.request_timeout_s)
        cold = model.autoscaling is not None and self.state.scaled_to_zero(model, self.state.routing(model, ctx.version))
        if cold:
            wait = max(wait, model.autoscaling.cold_start_timeout_s)  # type: ignore[union-attr]
        ticket = ctx.ticket
        cost = max(1, ticket.tokens_at_most) if ticket is not None else 1
        charge = await queue.enter(wait, rank, asker.tenant, asker.share, cost, slots=weight)
        if charge is None:
            tel.refused("cold_start_timeout" if cold else "queue_timeout")
            raise not_taken(model, wait, cold, gate.retry_after_s(queue.ahead_of(rank), rank, retry_key, weight))
        tel.turn()
        end.dispatched(queue, charge)

    def admit_internal(self, model: ModelConfig, make_end: Callable[[], RequestEnd]) -> RequestEnd | None:
        """A request of the platform's own (the tier monitor's), in the default class: admitted only while
        the model is under its admission bound (monitoring never adds to an overload), without waiting for
        a turn. Admitted: its `RequestEnd`, made only then (a skipped request starts no telemetry), holding
        its admission; else None."""
        gate, rank = self.state.gate(model), self.config.flow_control.rank(self.config.flow_control.default_class)
        if gate.try_admit(self.state.capacity(model), rank=rank) is not None:
            return None
        end = make_end()
        end.hold(gate, 1, rank)
        return end

    # ---- shared -----------------------------------------------------------------------------------------

    def _max_wait(self, model: ModelConfig, priority_class: str) -> float:
        """How long a request of the class may wait for a slot: its class's deadline. It is never admitted when
        expected to wait longer (it would end in a 503 after that wait), nor past the model's own wait budget."""
        limits = self.config.gateway.limits
        deadline = self.config.flow_control.max_wait_s(priority_class, self.config.gateway.queue_timeout_s,
                                                       limits.request_timeout_s)
        return min(model.admission.max_wait_s or math.inf, deadline)

    def _queue_full(self, model: ModelConfig, priority_class: str, rank: int, retry_after: int) -> ApiError:
        """The 429 of a model whose gate refused a request (counted in `shunter_rejections_total`). It names
        the places kept for refused requests' retries (this one's too, where its Retry-After keeps one): they
        count against the bound, so a request can be refused with fewer than the bound waiting."""
        ops_metrics.rejection(model.name, "queue_full")
        gate, capacity = self.state.gate(model), self.state.capacity(model)
        wait = gate.expected_wait_s(capacity, rank, self.state.dispatch(model).ahead_of(rank))
        about = f" (about {wait:.0f}s of waiting)" if wait else ""
        kept = gate.places.kept_through(rank)
        places = f", and {kept} place{'s are' if kept > 1 else ' is'} kept for refused requests' retries" if kept else ""
        return ApiError(429, f"model {model.name!r} is overloaded: {gate.queued(capacity, rank)} requests are "
                        f"already waiting for a replica (priority class {priority_class!r} or more urgent){places}"
                        f"{about}; retry in {retry_after}s", code="queue_full", headers={"Retry-After": str(retry_after)})


def _asker(caller: Caller | None, queue: FlowQueue, rank: int) -> tuple[Asker, int]:
    """Whose request this is at its model's gate, and the slots that must free before its turn: its own
    place in its class's fair queue (the gate's fair part of the bound follows it)."""
    tenant = caller.name if caller is not None else ""
    share = caller.config.weight if caller is not None and caller.config is not None else 1.0
    return Asker(tenant, share, queue.waiting_of(rank, tenant)), queue.ahead_of(rank, tenant)
