"""The forward pipeline of one API request: the door's checks, then route, admit, attempt, fail over.

In order, each a refusal with its own status before any engine sees the request: who is calling (401,
403; shunter.deployments.gateway.access, before the body is read), the body (shunter.deployments.gateway.request_body),
the `model` field (400 missing, 404 unknown; `model: auto` resolved to a tier by
shunter.deployments.gateway.tiering), whether the model serves this endpoint (400), the request limits (400),
the caller's quota (429). Everything about the request's content (messages, sampling parameters,
context length) is checked by vLLM's own request models, once, on the parsed request. Then: the version
under the live weights (a conversation keeps its version), the model's admission gate (429 past its
bound), the replica (shunter.deployments.gateway.replica_call, failing over once, then to the next version
taking traffic), and the reply: whole, or relayed as a stream (shunter.deployments.gateway.relay). The door
builds the request's typed context (shunter.deployments.gateway.context); every obligation picked up on
the way is discharged once when its `RequestEnd` settles on the request's one `Outcome`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shunter import ray_compat
from shunter.auth import Caller, cache_salt
from shunter.config import DEFAULT_VERSION, ModelConfig, ShunterConfig
from shunter.deployments.gateway.access import AccessControl
from shunter.deployments.gateway.context import (
    Ending,
    Outcome,
    RequestContext,
    engine_body,
    refused,
    served,
)
from shunter.deployments.gateway.flow.door import FlowControl, RefusedUnparsed
from shunter.deployments.gateway.flow.priority import PRIORITY_HEADER
from shunter.deployments.gateway.lora import Adapter, LiveAdapters
from shunter.deployments.gateway.parsed_request import parse as parse_body
from shunter.deployments.gateway.rate_headers import remember
from shunter.deployments.gateway.relay import relay
from shunter.deployments.gateway.replica_call import ReplicaCalls, VersionFailed
from shunter.deployments.gateway.request_body import BodyReader, model_field, parse
from shunter.deployments.gateway.request_end import STATE_KEY, Reply, RequestEnd, UsageWriter, standard_hooks
from shunter.deployments.gateway.serving_state import ServingState, all_replicas_out
from shunter.deployments.gateway.stream_account import StreamAccount
from shunter.deployments.gateway.telemetry import RequestTelemetry
from shunter.deployments.gateway.tiering import Tiering
from shunter.deployments.gateway.traffic import LiveVersions
from shunter.deployments.token_channel import GatewayChannels
from shunter.endpoints import Endpoint, ParsedRequest
from shunter.errors import ApiError
from shunter.replica_protocol import RequestLimits
from shunter.routing.versions import choose_version

log = logging.getLogger("ray.serve")

REPLICA_HEADER = "x-shunter-replica"  # which replica served the request: for operators and tests
# What share of the prompt the router believed the chosen replica held: "<share> precise|approximate" (the
# usage's prompt_tokens_details.cached_tokens says how many tokens its engine really had).
PREFIX_HEADER = "x-shunter-prefix-predicted"
VERSION_HEADER = "x-shunter-version"  # which version of the model served it
SESSION_HEADER = "x-shunter-session"  # requests with the same value (or the same `user`) stay on one version


class _FullBeforeParsing(Exception):
    """A full model's refusal before the body was parsed, with the context its records need."""

    def __init__(self, ctx: RequestContext, refusal: ApiError):
        super().__init__(refusal.message)
        self.ctx, self.refusal = ctx, refusal


class Forwarder:
    def __init__(self, config: ShunterConfig, access: AccessControl, body: BodyReader, state: ServingState,
                 traffic: LiveVersions, tiering: Tiering | None, adapters: LiveAdapters, usage: UsageWriter | None = None):
        self.config, self.access, self.body, self.state = config, access, body, state
        self.adapters = adapters
        self.traffic, self.tiering = traffic, tiering
        self.calls = ReplicaCalls(state, config.gateway.queue_timeout_s,
                                  GatewayChannels() if config.gateway.token_channel else None)
        self.hooks = standard_hooks(traffic, usage)  # what every request's outcome is told to
        self.flow = FlowControl(config, state)  # who waits, who goes first, who is turned away

    async def forward(self, request: Request, endpoint: Endpoint) -> Response:
        """One request of `endpoint`'s API, from the door to its reply; every refusal in the API's own
        error envelope."""
        try:
            ctx = await self._door(request, endpoint)
        except _FullBeforeParsing as full:  # a full model's: settled, counted and logged as any refusal
            end = RequestEnd(full.ctx, RequestTelemetry(full.ctx, request.headers), self.hooks)
            end.tel.refused("queue_full")
            end.settle(refused(full.refusal.status))
            return self._with_headers(full.ctx, error_reply(endpoint, full.refusal))
        except ApiError as refusal:  # refused at the door: nothing taken yet, nothing to settle
            return error_reply(endpoint, refusal)
        end = RequestEnd(ctx, RequestTelemetry(ctx, request.headers, self._prompt_for_logs(ctx.parsed.body)),
                         self.hooks)
        request.scope.setdefault("state", {})[STATE_KEY] = end  # the ASGI guard settles what we do not
        try:
            with end.settled_on_failure():
                return await self.serve(end, _retry_key(request, ctx.caller))
        except ApiError as refusal:
            return self._with_headers(ctx, error_reply(endpoint, refusal))

    async def _door(self, request: Request, endpoint: Endpoint) -> RequestContext:
        """Who asks, what, of which model, within which limits: the request's context, or a refusal."""
        caller = self.access.client(request.headers)  # before the body is read: strangers cost nothing
        remember(request, self.access, caller)  # its rate-limit headers on whatever it is answered
        body = await self.body.read_json(request)
        name = model_field(body)
        try:  # before the costly part of the door
            self.flow.refuse_if_full(request, endpoint, caller, name, body, _retry_key(request, caller))
        except RefusedUnparsed as full:
            # Its context holds the body as it came (never parsed): only the refusal's records read it.
            model = self.config.find_model(name)
            assert model is not None
            raise _FullBeforeParsing(RequestContext(endpoint, ParsedRequest(endpoint, body), model, _request_id(),
                                                    caller=caller, priority_class=full.priority_class),
                                     full.refusal) from None
        # Validate once, on typed values: every decision below reads the parsed request.
        parsed = await parse(request, endpoint, body)
        return self.context(caller, parsed, name, request.headers, _session(request, parsed.body))

    def context(self, caller: Caller, parsed: ParsedRequest, name: str, headers: Mapping[str, str],
                session: str | None, batch: bool = False) -> RequestContext:
        """The rest of the door, on the parsed request: the model (or tier, or adapter), whether the key may
        use it and the model serves the request, the limits, the priority class (`batch`: a batch's line,
        always in the least urgent class). ApiError for a refusal."""
        endpoint = parsed.endpoint
        tier = None
        if self.tiering is not None and name == self.tiering.name:
            tier = self.tiering.classify(endpoint, parsed.body, headers, caller.may_use)
            name = tier.tier.model
        model, adapter = self._resolve_model(name, caller)
        # Before saying anything more about the model.
        self.access.check_model(caller, adapter.name if adapter is not None else model.name,
                                base=model.name if adapter is not None else None)
        check_serving(model, parsed)
        self.access.check_limits(parsed)
        priority_class = self.flow.class_of(caller, parsed, headers, batch)
        route = self.adapters.route(adapter, session) if adapter is not None else None
        # The engine knows the canonical name only (an adapter's version under rollout, its own).
        engine_name = route.engine_name if route is not None else model.name
        # Tenants' prompt caches apart: nothing cached for one key shows to another.
        salt = cache_salt(caller, parsed.body.get("cache_salt"))
        # An engine that schedules by priority runs the more urgent classes first (0: the most urgent).
        priority = self.flow.engine_priority(model, priority_class)
        return RequestContext(endpoint, parsed, model, _request_id(), caller=caller, adapter=route, tier=tier,
                              session=session, priority_class=priority_class,
                              price_multiplier=self.config.flow_control.price_multiplier(priority_class),
                              engine_body=engine_body(parsed, engine_name, salt, priority,
                                                      self.config.flow_control.served_tier(priority_class)))

    async def serve(self, end: RequestEnd, retry_key: tuple[str, bytes] | None) -> Response:
        """The quota, then the model's admission and the replicas, within the request timeout."""
        ctx, tel = end.ctx, end.tel
        if ctx.tier is not None:
            self.tiering.follow(ctx, tel.span, self.ask_internal)  # type: ignore[union-attr]
        assert ctx.caller is not None
        try:
            ticket = ctx.ticket = self.access.admit(ctx.caller, ctx.model.name, ctx.parsed,
                                                    ctx.model.engine.max_model_len)
        except ApiError as refusal:  # the key's own quota: counted with the flow's refusals, by class
            tel.refused(str(refusal.code))
            raise
        ctx.limits = RequestLimits(max_tokens=ticket.default_max_tokens,
                                   max_prompt_tokens=self.config.gateway.limits.max_prompt_tokens)
        timeout = self.config.gateway.limits.request_timeout_s
        with tel.use():
            try:
                response = await asyncio.wait_for(self._admit(end, retry_key), timeout)
            except TimeoutError:
                log.warning("model %s request %s: no reply within the request timeout of %gs", ctx.model.name,
                            ctx.request_id, timeout)
                end.settle(Outcome(Ending.TIMED_OUT, 504, finished=False))
                response = error_reply(ctx.endpoint, ApiError(
                    504, f"the request to model {ctx.model.name!r} did not finish within the request timeout of "
                    f"{timeout:g}s", code="request_timeout"))
        return self._with_headers(ctx, response)

    def _with_headers(self, ctx: RequestContext, response: Response) -> Response:
        """The request's priority class and the tier's on every answer past the door (the caller's rate-limit
        headers are added as the response starts: shunter.deployments.gateway.rate_headers)."""
        response.headers[PRIORITY_HEADER] = ctx.priority_class
        if ctx.tier is not None:
            response.headers.update(self.tiering.headers(ctx.tier))  # type: ignore[union-attr]
        return response

    async def ask_internal(self, model_name: str, endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any] | None:
        """One whole (not streamed) request of the platform's own, through the model's routing and
        failover like any other; counted under endpoint `tier_monitor`. Skipped (None) when the model is
        at its admission bound: monitoring never adds to an overload."""
        model = self.config.find_model(model_name)
        if model is None:
            return None
        try:
            parsed = parse_body(endpoint, body)
        except ApiError:
            return None
        priority = self.flow.engine_priority(model, self.config.flow_control.default_class)
        ctx = RequestContext(endpoint, parsed, model, uuid.uuid4().hex,
                             engine_body=engine_body(parsed, model.name, None, priority),
                             limits=RequestLimits(max_tokens=self.config.gateway.limits.max_tokens,
                                                  max_prompt_tokens=self.config.gateway.limits.max_prompt_tokens))
        versions = self._versions_for(ctx)
        end = self.flow.admit_internal(
            model, lambda: RequestEnd(ctx, RequestTelemetry(ctx, {}, label="tier_monitor"), self.hooks)) \
            if versions else None
        if end is None:
            return None
        try:  # the same path as a client's whole reply: versions, failover, breakers, outcome records
            with end.settled_on_failure():
                response = await self._admitted(end, versions)
        except ApiError:
            return None
        return json.loads(bytes(response.body)) if response.status_code == 200 else None

    async def _admit(self, end: RequestEnd, retry_key: tuple[str, bytes] | None) -> Response:
        """The version the request goes to, flow control (the model's gate and flow queue), then the
        replicas. `retry_key`: who asks for what, so a refused request's retry finds its place."""
        self.traffic.ensure_started()
        ctx = end.ctx
        versions = self._versions_for(ctx)
        if not versions:
            # Every replica's breaker is open: say so at once rather than queue behind failing replicas.
            ctx.version = self._versions_for(ctx, skip_unavailable=False)[0]
            raise all_replicas_out(ctx.model, self.state.routing(ctx.model, ctx.version))
        ctx.version = versions[0]
        await self.flow.admit(end, retry_key)
        return await self._admitted(end, versions)

    def _prompt_for_logs(self, body: dict[str, Any]) -> str | None:
        """The prompt, for logs and spans, only where the config allows it (off by default)."""
        if not self.config.observability.logging.log_prompts:
            return None
        prompt = body.get("messages", body.get("prompt", body.get("input")))
        return json.dumps(prompt)[:4096]

    def _versions_for(self, ctx: RequestContext, skip_unavailable: bool = True) -> list[str]:
        """The version this request goes to under the live weights (a conversation keeps its version),
        then the other versions taking traffic, as fallbacks should it fail before its first byte.
        Versions whose every replica is out (breakers open) are left out."""
        model = ctx.model
        if not model.versioned:
            chosen, others = DEFAULT_VERSION, []
        else:
            view = self.traffic.view(model)
            chosen = choose_version(model.name, view.weights, ctx.session)
            others = [v for v, w in view.weights if w > 0 and v != chosen]
        ordered = [chosen, *others]
        if not skip_unavailable:
            return ordered
        return [v for v in ordered if self.state.routing(model, v).unavailable_for_s() is None]

    async def _admitted(self, end: RequestEnd, versions: list[str]) -> Response:
        """The request on the first version that can take it; the reply, whole or relayed as a stream."""
        ctx, tel = end.ctx, end.tel
        model = ctx.model
        began = time.monotonic()
        for i, version in enumerate(versions):
            routing = self.state.routing(model, version)
            try:
                started = await self.calls.start(ctx, tel, version, routing)
            except VersionFailed as failed:
                self.traffic.record_request(model, ctx.adapter, version, False, None, None)
                if i + 1 < len(versions):
                    log.warning("model %s request %s: version %s could not take it (%s); trying version %s",
                                model.name, ctx.request_id, version, failed.refusal.status, versions[i + 1])
                    continue
                raise failed.refusal from None
            tel.answered()
            headers = {REPLICA_HEADER: started.replica, VERSION_HEADER: version}
            prediction = routing.prediction(started.routing_id)
            if prediction is not None:
                headers[PREFIX_HEADER] = f"{prediction[0]:.3f} {prediction[1]}"
            head = started.head
            reply = Reply(started.stream, started.replica, started.routing_id, routing, version, began,
                          time.monotonic() - began, head.stream)
            if not head.stream:
                tel.whole_reply()
                ctx.usage.whole_reply(head.body)
                end.attach(reply)
                end.settle(served(head.status))
                body = head.body if head.status < 400 else ctx.endpoint.wire.error_body(head.body, head.status)
                return JSONResponse(body, status_code=head.status, headers=headers)
            account = StreamAccount(ctx.usage, tel.token)
            # Timed on arrival, not when the relay sends it.
            first = account.take(started.first_chunk) if started.first_chunk is not None else None
            reply.drains, reply.on_release = self.state.drains(model), started.close_inbox
            end.attach(reply)
            return StreamingResponse(relay(started, end, account, first, self.config.gateway.limits),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        raise AssertionError("no version to send to")  # forward never passes an empty list

    def _resolve_model(self, name: str, caller: Caller) -> tuple[ModelConfig, Adapter | None]:
        """The model `name` names, and the adapter when it names one of a model's LoRA adapters."""
        model = self.config.find_model(name)
        if model is not None:
            return model, None
        adapter = self.adapters.find(name)
        if adapter is not None:
            return adapter.base, adapter
        visible = [m.name for m in self.config.models if caller.may_use(m.name)]
        raise ApiError(404, f"model {name!r} does not exist; models this key may use: "
                       f"{', '.join(visible) or 'none'} (GET /v1/models)", param="model",
                       code="model_not_found")


def error_reply(endpoint: Endpoint, refusal: ApiError) -> JSONResponse:
    """A refusal in the endpoint's error envelope (OpenAI's, or Anthropic's for the Messages API)."""
    return JSONResponse(endpoint.wire.error_body(refusal.body(), refusal.status), status_code=refusal.status,
                        headers=refusal.headers or None)


def check_serving(model: ModelConfig, parsed: ParsedRequest) -> None:
    """A request the model cannot serve gets a 400: the wrong endpoint for its task, or tools where its
    serving options leave them off (naming the option)."""
    if parsed.endpoint.task != model.task:
        what = "an embedding model; use /v1/embeddings" if model.task == "embed" else \
            "a generative model; use /v1/chat/completions, /v1/completions, /v1/responses or /v1/messages"
        raise ApiError(400, f"model {model.name!r} is {what}", param="model", code="model_not_supported")
    choice, serving = parsed.tool_choice, model.serving
    if choice is None or choice == "none":
        return
    if serving.tool_call_parser is None:
        raise ApiError(400, f"model {model.name!r} is not set up for tool calling (tool_choice {choice!r}): its "
                       "config sets no `serving.tool_call_parser`; send tool_choice 'none' or leave the tools out",
                       param="tools", code="tools_not_supported")
    if choice == "auto" and not serving.auto_tool_choice:
        raise ApiError(400, f"model {model.name!r} does not choose tools itself (tool_choice 'auto', the default "
                       "with tools): its config sets `serving.enable_auto_tool_choice: false`; send tool_choice "
                       "'required' or name a function", param="tool_choice", code="tool_choice_not_supported")


def _session(request: Request | None, body: dict[str, Any]) -> str | None:
    """A request's conversation: the session header, else the `user` field (None: it belongs to none)."""
    header = request.headers.get(SESSION_HEADER) if request is not None else None
    user = body.get("user")
    return header or (user if isinstance(user, str) and user else None)


def _retry_key(request: Request, caller: Caller | None) -> tuple[str, bytes] | None:
    """Who asks for what (the caller, the body's digest): a refused request's retry finds the place its
    refusal keeps by it."""
    digest = getattr(request.state, "body_digest", None)
    return (caller.name if caller is not None else "", digest) if digest is not None else None


def _request_id() -> str:
    """Ray Serve's id of the request being handled (from the client's `X-Request-ID`, or made by Serve's
    proxy, which returns it in the response's `x-request-id`), so Serve's access log, Shunter's logs
    and spans, and the client all name a request the same way (`shunter.ray_compat.serve_request_id`)."""
    return ray_compat.serve_request_id() or uuid.uuid4().hex
