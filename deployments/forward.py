"""The forward pipeline of one OpenAI request: the door's checks, then route, admit, attempt, fail over.

In order, each a refusal with its own status before any engine sees the request: who is calling (401,
403; shunter.deployments.access, before the body is read), the body (shunter.deployments.request_body),
the `model` field (400 missing, 404 unknown; `model: auto` resolved to a tier by
shunter.deployments.tiering), whether the model serves this endpoint (400), the request limits (400),
the caller's quota (429). Everything about the request's content (messages, sampling parameters,
context length) is checked by vLLM's own request models, once, on the parsed request. Then: the version
under the live weights (a conversation keeps its version), the model's admission gate (429 past its
bound), the replica (shunter.deployments.replica_call, failing over once, then to the next version
taking traffic), and the reply: whole, or relayed as a stream (shunter.deployments.relay). Every
obligation picked up on the way is discharged once by the request's `RequestEnd`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shunter.auth import Caller, cache_salt
from shunter.config import DEFAULT_VERSION, ModelConfig, ShunterConfig
from shunter.deployments.access import AccessControl
from shunter.deployments.adapters import Adapter, LiveAdapters, rollout_key
from shunter.deployments.api_app import error_response
from shunter.deployments.parsed_request import ParsedRequest
from shunter.deployments.relay import relay
from shunter.deployments.replica_call import ReplicaCalls, VersionFailed, not_taken
from shunter.deployments.request_body import BodyReader, model_field, parse
from shunter.deployments.request_end import CLIENT_GONE, RequestEnd
from shunter.deployments.serving_state import ServingState, all_replicas_out
from shunter.deployments.telemetry import RequestTelemetry, ask_for_usage
from shunter.deployments.tiering import Tiering
from shunter.deployments.token_channel import GatewayChannels
from shunter.deployments.traffic import LiveVersions
from shunter.errors import ApiError
from shunter.ops import metrics as ops_metrics
from shunter.replica_protocol import RequestLimits
from shunter.routing.tiers import Decision
from shunter.routing.versions import choose_version

log = logging.getLogger("ray.serve")

# Which model task serves which endpoint.
_ENDPOINT_TASK = {"chat": "generate", "completion": "generate", "embedding": "embed", "responses": "generate",
                  "messages": "generate"}
REPLICA_HEADER = "x-shunter-replica"  # which replica served the request: for operators and tests
# What share of the prompt the router believed the chosen replica held: "<share> precise|approximate" (the
# usage's prompt_tokens_details.cached_tokens says how many tokens its engine really had).
PREFIX_HEADER = "x-shunter-prefix-predicted"
VERSION_HEADER = "x-shunter-version"  # which version of the model served it
SESSION_HEADER = "x-shunter-session"  # requests with the same value (or the same `user`) stay on one version


class Forwarder:
    def __init__(self, config: ShunterConfig, access: AccessControl, body: BodyReader, state: ServingState,
                 traffic: LiveVersions, tiering: Tiering | None, adapters: LiveAdapters):
        self.config, self.access, self.body, self.state = config, access, body, state
        self.adapters = adapters
        self.traffic, self.tiering = traffic, tiering
        self.calls = ReplicaCalls(state, config.gateway.queue_timeout_s,
                                  GatewayChannels() if config.gateway.token_channel else None)
        self.replica_limits = RequestLimits(max_tokens=config.gateway.limits.max_tokens,
                                            max_prompt_tokens=config.gateway.limits.max_prompt_tokens)
        self._background: set[asyncio.Task] = set()  # the tier monitor's comparisons, kept referenced

    async def forward(self, request: Request, endpoint: str) -> Response:
        caller = self.access.client(request.headers)  # before the body is read: strangers cost nothing
        body = await self.body.read_json(request)
        name = model_field(body)
        # Validate once, on typed values: every decision below reads the parsed request.
        parsed = await parse(request, endpoint, body)
        body = parsed.body
        tier = None
        if self.tiering is not None and name == self.tiering.name:
            tier = self.tiering.classify(endpoint, body, request.headers, caller.may_use)
            name = tier.tier.model
        model, adapter = self._resolve_model(name, caller)
        served = adapter.name if adapter is not None else model.name  # what the engine knows it by
        # Before saying anything more about the model.
        self.access.check_model(caller, served, base=model.name if adapter is not None else None)
        check_serving(model, endpoint, parsed)
        self.access.check_limits(parsed)
        route = self.adapters.route(adapter, _session(request, body)) if adapter is not None else None
        # The engine knows the canonical name only (an adapter's version under rollout, its own).
        body = {**body, "model": route.engine_name if route is not None else served}
        if endpoint != "embedding" and (salt := cache_salt(caller, body.get("cache_salt"))) is not None:
            body["cache_salt"] = salt  # tenants' prompt caches apart: nothing cached for one key shows to another
        tel = RequestTelemetry(model.name, endpoint, request.headers, _request_id(), parsed.usage_chunk,
                               log_prompt=self._prompt_for_logs(body), continuous_usage=parsed.continuous_usage)
        tel.choices_per_prompt = parsed.n
        if route is not None:
            tel.use_adapter(route)
        end = RequestEnd(tel)
        response: Response | None = None
        try:
            if tier is not None:
                self._follow_tier(tier, endpoint, body, tel)
            ticket = self.access.admit(caller, model.name, parsed, model.engine.max_model_len)
            end.reserve(ticket)
            limits = RequestLimits(max_tokens=ticket.default_max_tokens,
                                   max_prompt_tokens=self.config.gateway.limits.max_prompt_tokens)
            timeout = self.config.gateway.limits.request_timeout_s
            with tel.use():
                try:
                    response = await asyncio.wait_for(
                        self._admit(request, model, endpoint, body, end, limits, parsed.engine_requests), timeout)
                except asyncio.TimeoutError:
                    log.warning("model %s request %s: no reply within the request timeout of %gs", model.name,
                                tel.request_id, timeout)
                    response = error_response(504, f"the request to model {model.name!r} did not finish within "
                                              f"the request timeout of {timeout:g}s", code="request_timeout")
            response.headers.update(ticket.headers)
            if tier is not None:
                response.headers.update(self.tiering.headers(tier))  # type: ignore[union-attr]
            return response
        except ApiError as refused:
            end.settle(refused.status, finished=False)
            raise
        except asyncio.CancelledError:  # the client left while the request waited or ran
            end.settle(CLIENT_GONE, finished=False)
            raise
        except BaseException:
            end.settle(500, finished=False)
            raise
        finally:
            if response is not None and not isinstance(response, StreamingResponse):
                end.settle(response.status_code, ok=True)  # a stream settles when its relay ends

    def _follow_tier(self, tier: Decision, endpoint: str, body: dict[str, Any], tel: RequestTelemetry) -> None:
        """A tier-routed request: its decision on the trace, its tokens and cost when it ends, and, for a
        sampled one, the monitor's comparison of both tiers once it has been answered."""
        tiering = self.tiering
        assert tiering is not None
        tel.span.set_attributes({"shunter.tier": tier.tier.name, "shunter.tier.class": tier.request_class,
                                 "shunter.tier.complexity": tier.complexity, "shunter.tier.reason": tier.reason})
        tel.on_finish.append(lambda status, prompt, completion: tiering.finished(tier, status, prompt, completion))
        if endpoint not in ("chat", "completion") or not tiering.sampled(tier):
            return  # the monitor compares chat and completion answers
        asked = dict(body)

        def compare(status: int | str, prompt: int, completion: int) -> None:
            if str(status) != "200":
                return
            try:
                task = asyncio.get_running_loop().create_task(
                    tiering.judge(tier, endpoint, asked, self.ask_internal))
            except RuntimeError:  # finished outside the event loop (a dropped relay): skip the sample
                return
            self._background.add(task)
            task.add_done_callback(self._background_done)

        tel.on_finish.append(compare)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("tier monitor: a comparison failed: %r", task.exception())

    async def ask_internal(self, model_name: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """One whole (not streamed) request of the platform's own, through the model's routing and
        failover like any other; counted under endpoint `tier_monitor`. Skipped (None) when the model is
        at its admission bound: monitoring never adds to an overload."""
        model = self.config.find_model(model_name)
        if model is None:
            return None
        versions = self._versions_for(model, None, body)
        gate = self.state.gate(model)
        if not versions or gate.try_admit(self.state.capacity(model)) is not None:
            return None
        end = RequestEnd(RequestTelemetry(model.name, "tier_monitor", {}, uuid.uuid4().hex))
        end.hold(gate)
        response: Response | None = None
        try:  # the same path as a client's whole reply: versions, failover, breakers, outcome records
            response = await self._admitted(model, endpoint, body, versions, end, self.replica_limits)
        finally:
            end.settle(response.status_code if response is not None else 503, finished=response is not None,
                       ok=True if response is not None else None)
        return json.loads(bytes(response.body)) if response.status_code == 200 else None

    async def _admit(self, request: Request, model: ModelConfig, endpoint: str, body: dict[str, Any],
                     end: RequestEnd, limits: RequestLimits, engine_requests: int = 1) -> Response:
        self.traffic.ensure_started()
        tel = end.tel
        versions = self._versions_for(model, request, body)
        if not versions:
            # Every replica's breaker is open: say so at once rather than queue behind failing replicas.
            chosen = self._versions_for(model, request, body, skip_unavailable=False)[0]
            tel.version = chosen
            return all_replicas_out(model, self.state.routing(model, chosen))
        tel.version = versions[0]
        gate = self.state.gate(model)
        capacity = self.state.capacity(model)
        # Never admit a request expected to wait for a slot past the queue timeout (it would end in a 503
        # after that wait), nor past the model's own wait budget.
        max_wait = min(model.admission.max_wait_s or math.inf, self.config.gateway.queue_timeout_s)
        # A batch (embedding inputs, completion prompts, choices) is that many engine requests' worth of work.
        weight = gate.admitted_weight(capacity, engine_requests)
        retry_after = gate.try_admit(capacity, max_wait, weight)
        if retry_after is not None:
            ops_metrics.rejection(model.name, "queue_full")
            wait = gate.expected_wait_s(capacity)
            about = f" (about {wait:.0f}s of waiting)" if wait else ""
            return error_response(429, f"model {model.name!r} is overloaded: {gate.queued(capacity)} requests are "
                                  f"already waiting for a replica{about}; retry in {retry_after}s", code="queue_full",
                                  headers={"Retry-After": str(retry_after)})
        end.hold(gate, weight)
        tel.admitted()
        queue = self.state.dispatch(model)
        wait = self.config.gateway.queue_timeout_s
        cold = model.autoscaling is not None and self.state.scaled_to_zero(model, self.state.routing(model, versions[0]))
        if cold:
            wait = max(wait, model.autoscaling.cold_start_timeout_s)  # type: ignore[union-attr]
        if not await queue.enter(wait):
            return not_taken(model, wait, cold)
        end.dispatched(queue)
        return await self._admitted(model, endpoint, ask_for_usage(body, endpoint), versions, end, limits)

    def _prompt_for_logs(self, body: dict[str, Any]) -> str | None:
        """The prompt, for logs and spans, only where the config allows it (off by default)."""
        if not self.config.observability.logging.log_prompts:
            return None
        prompt = body.get("messages", body.get("prompt", body.get("input")))
        return json.dumps(prompt)[:4096]

    def _versions_for(self, model: ModelConfig, request: Request | None, body: dict[str, Any],
                      skip_unavailable: bool = True) -> list[str]:
        """The version this request goes to under the live weights (a conversation keeps its version),
        then the other versions taking traffic, as fallbacks should it fail before its first byte.
        Versions whose every replica is out (breakers open) are left out."""
        if not model.versioned:
            chosen, others = DEFAULT_VERSION, []
        else:
            view = self.traffic.view(model)
            chosen = choose_version(model.name, view.weights, _session(request, body))
            others = [v for v, w in view.weights if w > 0 and v != chosen]
        ordered = [chosen, *others]
        if not skip_unavailable:
            return ordered
        return [v for v in ordered if self.state.routing(model, v).unavailable_for_s() is None]

    async def _admitted(self, model: ModelConfig, endpoint: str, body: dict[str, Any], versions: list[str],
                        end: RequestEnd, limits: RequestLimits) -> Response:
        tel = end.tel
        began = time.monotonic()
        for i, version in enumerate(versions):
            routing = self.state.routing(model, version)
            try:
                started = await self.calls.start(model, version, routing, endpoint, body, tel, limits)
            except VersionFailed as failed:
                self._record(model, version, tel, False, None, None)
                if i + 1 < len(versions):
                    log.warning("model %s request %s: version %s could not take it (%s); trying version %s",
                                model.name, tel.request_id, version, failed.response.status_code, versions[i + 1])
                    continue
                return failed.response
            first_byte_s = time.monotonic() - began
            tel.answered()
            headers = {REPLICA_HEADER: started.replica, VERSION_HEADER: version}
            prediction = routing.prediction(started.routing_id)
            if prediction is not None:
                headers[PREFIX_HEADER] = f"{prediction[0]:.3f} {prediction[1]}"
            if not started.head["stream"]:
                tel.whole_reply(started.head["body"])
                routing.record_outcome(started.replica, False)
                status = started.head["status"]

                def whole(ok: bool, version: str = version, ttft: float = first_byte_s, status: int = status) -> None:
                    if status < 400:  # a client error says nothing about the version
                        self._record(model, version, tel, ok, None, ttft)

                end.attach(started.stream, started.replica, started.routing_id, routing, outcome=whole)
                return JSONResponse(started.head["body"], status_code=status, headers=headers)

            def streamed(ok: bool, version: str = version, ttft: float = first_byte_s) -> None:
                self._record(model, version, tel, ok, ttft, time.monotonic() - began)

            if started.first_chunk is not None:  # timed on arrival, not when the relay sends it
                started.first_chunk = tel.chunk(started.first_chunk)
            end.attach(started.stream, started.replica, started.routing_id, routing, self.state.drains(model),
                       streamed, started.close_inbox)
            return StreamingResponse(relay(started, model, routing, end, self.config.gateway.limits),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        raise AssertionError("no version to send to")  # forward never passes an empty list

    def _record(self, model: ModelConfig, version: str, tel: RequestTelemetry, ok: bool, ttft_s: float | None,
                e2e_s: float | None) -> None:
        """A request's outcome, for the gates of a rollout of its model's versions or of its adapter's."""
        self.traffic.record(model, version, ok, ttft_s, e2e_s)
        route = tel.adapter
        if route is not None and route.version is not None:
            self.traffic.record_key(rollout_key(model.name, route.name), route.version, ok, ttft_s, e2e_s)

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


def check_serving(model: ModelConfig, endpoint: str, parsed: ParsedRequest) -> None:
    """A request the model cannot serve gets a 400: the wrong endpoint for its task, or tools where its
    serving options leave them off (naming the option)."""
    if _ENDPOINT_TASK[endpoint] != model.task:
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


def _request_id() -> str:
    """Ray Serve's id of the request being handled (from the client's `X-Request-ID`, or made by Serve's
    proxy, which returns it in the response's `x-request-id`), so Serve's access log, Shunter's logs
    and spans, and the client all name a request the same way."""
    try:
        from ray.serve.context import _get_serve_request_context

        request_id = _get_serve_request_context().request_id
    except Exception:  # noqa: BLE001 - outside a Serve request (unit tests)
        request_id = ""
    return request_id or uuid.uuid4().hex
