"""ModelServer: one Ray Serve replica = one vLLM engine serving one model.

Start-up order matters for honesty about readiness: claim CPU cores (CPU only), prepare the model's
weights, start the engine, then answer one real request end to end. Only then does the constructor
return, so Ray Serve counts the replica as running only once it can really serve.

The replica speaks one streaming method, `handle(request)` (a `shunter.replica_protocol.ReplicaRequest`).
It yields, in order:
1. `Accepted(replica_id)`, at once: this replica has taken the request (the gateway bounds how long it
   waits for this, so a model with no replica able to take work gets a 503 instead of a hang, and learns
   which replica serves it, for its circuit breakers and failover);
2. the reply head `{status, body, stream}`: the gateway decides the HTTP status from it before any byte
   goes to the client (a non-streaming reply arrives whole, here, after `Working` heartbeats while it is
   computed: each says what the reply has produced so far, counted by shunter.engine_usage, so a client
   that leaves first is charged that; the gateway then cancels this call, which cancels the work, and vLLM
   aborts its engine requests);
3. if the reply streams, its chunks (`StreamChunk`: vLLM's own bytes with the tokens produced so far,
   shunter.deployments.replica.stream_reader) and then its `StreamEnd` (the final usage, an in-band
   error); after the first chunk, when the request names the gateway's token channel and that gateway is
   listening, `Moved` and the rest over the channel (`shunter.deployments.token_channel`), the Ray call
   ending with the stream.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from shunter.config import DEFAULT_VERSION, ModelConfig, ObservabilityConfig
from shunter.deployments.replica.stream_reader import StreamReader, chunk_tier, engine_stream_body
from shunter.deployments.replica.telemetry import EngineMetrics, record_start, traced
from shunter.deployments.token_channel import ReplicaChannel
from shunter.endpoints import ENDPOINTS, Endpoint
from shunter.engine import RequestFault
from shunter.engine_protocol import ServingEngine, require_engine
from shunter.engine_usage import Tally, request_tally
from shunter.errors import error_body
from shunter.kv_events import prompt_observer
from shunter.ops.autoscaling import ENGINE_REQUESTS_METRIC
from shunter.replica_protocol import (
    Accepted,
    EngineLoad,
    Moved,
    ReplicaRequest,
    ReplyHead,
    RouteHint,
    StreamChunk,
    StreamEnd,
    Working,
)
from shunter.routing.prefix import prefix_key, render_prompt
from shunter.tracing import correlate_logs, setup_tracing

log = logging.getLogger("ray.serve")

_PROGRESS_S = 1.0  # how often a whole reply's heartbeat may report its tokens (when they changed)
_ENGINE_WATCH_S = 0.5  # how often the replica looks whether its engine is still alive


class ModelServer:
    """Deployment class; the app builder wraps it with `serve.deployment` options per model."""

    async def __init__(
        self,
        model: dict[str, Any],
        cache_dir: str | None,
        cpu_cores: int | None,
        accelerator: str,
        engine_factory: str | None = None,
        version: str = DEFAULT_VERSION,
        observability: dict[str, Any] | None = None,
    ):
        """`model` is the model as this version serves it (`ModelConfig.for_version`). `engine_factory`
        ("module:callable", same signature as VLLMEngine.start, starting a `shunter.engine_protocol.ServingEngine`)
        is a test seam for fault-injecting fake engines; production apps always run vLLM."""
        import psutil

        from shunter.engine import PhaseClock

        clock = PhaseClock(since=psutil.Process().create_time())
        clock.mark("process")
        if accelerator == "cpu" and model.get("engine", {}).get("process_start", "auto") != "spawn":
            from shunter.engine_forkserver import node_server

            node_server()  # the first replica on a node: the server's imports run beside this replica's
        from shunter.catalog import resolve_source
        from shunter.cpu_cores import claim_cores, node_cores
        from shunter.deployments.replica.placement import engine_group
        from shunter.engine import EngineSpec, VLLMEngine, cpu_engine_env, yield_cpu_to_platform
        from shunter.placement import EngineLayout

        self.model = ModelConfig.model_validate(model)
        self.version = version
        setup_tracing(ObservabilityConfig.model_validate(observability or {}).tracing, "model_server")
        correlate_logs()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # Well inside the gateway's silence bound, so a reply still being computed is never taken for a hang.
        self._heartbeat_s = max(0.5, min(10.0, self.model.routing.replica_timeout_s / 3))
        self._cores = None
        self._group = None
        self._retire: tuple[float, float] | None = None  # (not before, at the latest): see `retire`
        self._channel = ReplicaChannel(ray.util.get_node_ip_address())
        env: dict[str, str] = {}
        engine = self.model.engine
        layout = EngineLayout(engine.tensor_parallel_size, engine.pipeline_parallel_size, self.model.accelerator_type)
        if accelerator == "cpu" and cpu_cores == 0:  # shared: no cores of its own (one rank, checked)
            env = cpu_engine_env(engine.cpu_kv_cache_gib, ",".join(str(c) for c in node_cores()))
            log.info("model %s replica %s (pid %d): engine on the node's shared cores (VLLM_CPU_OMP_THREADS_BIND=%s)",
                     self.model.name, self.replica_id, os.getpid(), env["VLLM_CPU_OMP_THREADS_BIND"])
        elif accelerator == "cpu":
            self._cores = claim_cores(cpu_cores or 1)
            # Every engine rank (TP x PP worker processes) computes on its own share of the cores.
            env = cpu_engine_env(engine.cpu_kv_cache_gib, self._cores.omp_bind(ranks=layout.devices))
            log.info(
                "model %s replica %s (pid %d): engine bound to CPU cores %s (VLLM_CPU_OMP_THREADS_BIND=%s)",
                self.model.name, self.replica_id, os.getpid(), self._cores.cores, env["VLLM_CPU_OMP_THREADS_BIND"],
            )
        assert self.model.source is not None, "a replica serves one version: ModelConfig.for_version"
        start = _import_callable(engine_factory) if engine_factory else VLLMEngine.start
        try:
            if accelerator == "gpu":
                self._group = await engine_group(layout, f"{self.model.name}/{version}/{self.replica_id}")
            # Off the event loop: a builtin model is prepared once, a remote one copied once per node.
            path = await asyncio.to_thread(resolve_source, self.model.source, cache_dir, False,
                                           engine.extra_engine_args.get("load_format"))
            spec = EngineSpec(self.model.name, path, self.model.task, self.model.engine, accelerator,
                              self._group.placement_group if self._group else None, self.model.serving,
                              self.model.lora, tuple((a.name, a.source) for a in self.model.adapters),
                              prefix_events=self.model.precise_prefix_routing)
            clock.mark("replica_setup")
            # Called through its declared interface only: one that lacks a member is refused here, by name.
            self.engine: ServingEngine = require_engine(await start(spec, env))
            clock.add(self.engine.start_phases or {})
            await self.engine.warmup()
            clock.mark("warmup")
            if accelerator == "cpu":
                # The engine's threads own their cores; the gateway and HAProxy beside them must still get
                # a turn. Only once it is ready: it starts at the platform's own priority, so a replica
                # started under load is not starved by the load (shunter.engine.yield_cpu_to_platform).
                engine_pids = self.engine.process_ids()
                yield_cpu_to_platform(engine.cpu_nice, engine_pids)
                log.info("model %s replica %s (pid %d): engine processes %s at niceness %d (engine.cpu_nice)",
                         self.model.name, self.replica_id, os.getpid(), engine_pids, engine.cpu_nice)
        except BaseException:
            self._release_devices()
            raise
        # When the process started, when it was ready, and each phase between (shunter.engine.START_PHASES).
        self.start_record = {"process_started_at": clock.started, "ready_at": time.time(), "phases": clock.phases}
        record_start(clock, {"model": self.model.name, "version": version}, self.replica_id)
        log.info("model %s version %s replica %s ready (answered a real %s)", self.model.name, version,
                 self.replica_id, "embedding" if self.model.task == "embed" else "generation")
        self._metrics_task = asyncio.get_running_loop().create_task(
            EngineMetrics(self.engine, self.model.name, version, self.replica_id).run())
        self._engine_watch = asyncio.get_running_loop().create_task(self._exit_when_the_engine_dies())

    async def _exit_when_the_engine_dies(self) -> None:
        """A replica whose engine died can serve nothing again, so it ends at once, as vLLM's own server
        does: Serve replaces it on its next control loop, not after three failed health checks (4-6 s)
        and a graceful stop (measured by `shunter bench coldstart`, engine core killed). Every request it
        held had already failed with the engine; the gateway retries those not yet answered elsewhere."""
        while True:
            await asyncio.sleep(_ENGINE_WATCH_S)
            try:
                await self.engine.check_health()
            except Exception as exc:  # noqa: BLE001 - whatever the engine's death looks like
                log.error("model %s replica %s: its engine died (%s); the replica exits so that Serve "
                          "replaces it now", self.model.name, self.replica_id, exc)
                for handler in logging.getLogger("ray.serve").handlers:
                    handler.flush()
                self._release_devices()
                os._exit(1)

    async def handle(self, request: ReplicaRequest) -> AsyncIterator[Any]:
        """Serve one request: yields Accepted, the reply head, then SSE chunks if the reply streams."""
        if request.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {request.endpoint!r}")  # a gateway of another version
        async for item in self._relay(traced(self._serve(request), request.trace, request.endpoint,
                                             self.model.name, self.version, self.replica_id), request):
            yield item

    async def _serve(self, request: ReplicaRequest) -> AsyncIterator[Any]:
        counters = self.engine.counters
        load = EngineLoad(counters.running, counters.waiting, counters.kv_cache_usage) \
            if counters is not None and counters.steps else None
        yield Accepted(self.replica_id, self._channel.address, load)
        adapters, route = self.engine.adapters, request.adapter
        if route is not None and adapters is not None:
            adapters.register(route.engine_name, route.source)  # known already (the usual case): a lookup
        endpoint = ENDPOINTS[request.endpoint]
        body, refusal = await self._within_limits(endpoint, request)
        if refusal is not None:
            yield ReplyHead(400, refusal)
            return
        # A whole (not streamed) reply may take longer than the gateway's `replica_timeout_s`: while its
        # engine makes progress the replica says it is still working, so only a hang (no progress) is
        # silence, which the gateway counts as the replica's failure. Each heartbeat carries the tokens
        # produced so far (at most a second old): a client that leaves is charged them. Cancelled (the
        # client left), the work is cancelled and vLLM aborts its engine requests.
        linking = self._link_prefix(request)  # the task takes the observer with the context it copies
        produced = self.engine.produced
        streams = body.get("stream") is True
        body, usage_chunk_wanted = engine_stream_body(body, endpoint.wire)
        tier = chunk_tier(endpoint, body)
        tally = Tally() if produced is not None else None  # a stream's running usage too
        counting = request_tally.set(tally)  # so does the tally
        work = asyncio.ensure_future(endpoint.engine_call(self.engine, body))
        request_tally.reset(counting)
        if linking is not None:
            prompt_observer.reset(linking)
        progress = self.engine.progress
        seen, reported, said_at = progress() if progress else None, None, time.monotonic()
        tick = min(self._heartbeat_s, _PROGRESS_S) if tally is not None and not streams else self._heartbeat_s
        try:
            while not (await asyncio.wait({work}, timeout=tick))[0]:
                now = progress() if progress else None
                if now == seen and progress is not None:
                    continue  # no progress: silence
                seen = now
                if tally is None or streams:  # a stream's running usage comes with its chunks
                    yield Working()
                    continue
                try:
                    counts = produced(tally)  # type: ignore[misc]
                except Exception:  # noqa: BLE001 - counting never fails a request: it stops counting
                    log.warning("model %s: could not read a request's tokens so far", self.model.name, exc_info=True)
                    tally = None
                    yield Working()
                    continue
                if counts != reported or time.monotonic() - said_at >= self._heartbeat_s - tick:
                    reported, said_at = counts, time.monotonic()
                    yield Working(*counts)
        finally:
            if not work.done():
                work.cancel()
        reply = work.result()
        renamed = route is not None and route.engine_name != route.name
        if renamed and isinstance(reply.body, dict) and "model" in reply.body:
            reply.body["model"] = route.name  # type: ignore[union-attr]
        if tier is not None and reply.status == 200 and isinstance(reply.body, dict):
            reply.body["service_tier"] = tier  # the tier served, as OpenAI's replies say it
        yield ReplyHead(reply.status, reply.body, reply.stream is not None)
        if reply.stream is not None:
            engine_name = name = None
            if renamed:  # an adapter's other version under rollout: the client sees the adapter's name
                engine_name, name = f'"model":"{route.engine_name}"', f'"model":"{route.name}"'  # type: ignore[union-attr]
            counts = (lambda: produced(tally)) if tally is not None and produced is not None else None
            reader = StreamReader(endpoint.wire, counts, usage_chunk_wanted, tier)
            async for chunk in reply.stream:
                if isinstance(chunk, RequestFault):  # the request broke vLLM's layer mid-stream: its own error
                    yield reader.fault(endpoint.wire.error_event(chunk.message, chunk.status, chunk.code),
                                       error_body(chunk.message, chunk.status, code=chunk.code)["error"])
                    break
                item = reader.chunk(chunk.replace(engine_name, name) if engine_name else chunk)
                if item is not None:
                    yield item
            yield reader.end()

    def _link_prefix(self, request: ReplicaRequest) -> Any:
        """Precise prefix routing: once the engine has the request's prompt tokens, link the router's keys
        of this request (computed as the routers compute them, from the same body) to its token blocks,
        so the replica can report which keys its engine still holds. Returns the context token to reset."""
        view = self.engine.prefix_view
        if view is None:
            return None
        key = prefix_key(render_prompt(request.endpoint, request.body), view.index.block_size)
        if not key.keys:
            return None
        salt = request.body.get("cache_salt")  # the engine keys the blocks by it (the gateway's tenant salt)
        return prompt_observer.set(
            lambda tokens, lora: view.link(key.keys, key.chars, key.chunk_chars, tokens, lora, salt))

    async def _relay(self, items: AsyncIterator[Any], request: ReplicaRequest) -> AsyncIterator[Any]:
        """The reply's items on Ray, but a stream's chunks after the first, and its end, over the gateway's
        token channel once that gateway listens there."""
        gateway, moved, chunks = request.channel, False, 0
        async for item in items:
            if moved:
                self._channel.send(gateway, request.request_id, item)
                continue
            if isinstance(item, StreamChunk | StreamEnd):  # the other items: Accepted, the head, Working
                if chunks and gateway is not None and self._channel.ready(gateway):
                    yield Moved()
                    moved = True
                    self._channel.send(gateway, request.request_id, item)
                    continue
                chunks += 1
            yield item

    async def _within_limits(self, endpoint: Endpoint, request: ReplicaRequest) \
            -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The body to run, with the default max_tokens filled in; or a 400 body for a prompt past the
        limit. Only the replica knows the context length and has the tokenizer."""
        body, limits = request.body, request.limits
        # A request that names no completion budget would otherwise generate up to the context (a
        # completion that leaves it out gets OpenAI's and vLLM's default of 16: only its null is filled).
        field, fill = endpoint.max_tokens_field, endpoint.default_max_tokens
        unnamed = body.get(field) is None and body.get("max_completion_tokens") is None if field else False
        if limits.max_tokens is not None and unnamed and (fill == "absent" or (fill == "null" and field in body)):
            # vLLM refuses max_tokens past the context length and trims it to what the prompt leaves.
            body = {**body, field: min(limits.max_tokens, self.engine.max_model_len())}
        # A stream's prompts are rendered before it starts, so that what vLLM would find wrong only once it
        # streams (an empty prompt in a completion: an error event inside a 200) is a 400 instead.
        rendered_first = endpoint.renders_before_stream and body.get("stream") is True
        if limits.max_prompt_tokens is None and not rendered_first:
            return body, None
        lengths = await self.engine.prompt_lengths(request.endpoint, body)
        if not lengths:
            return body, None
        if endpoint.renders_before_stream and min(lengths) == 0:
            return body, error_body("The decoder prompt cannot be empty" + (
                f" (prompt {lengths.index(0)} of the batch)" if len(lengths) > 1 else ""), 400, param="prompt")
        tokens = sum(lengths)  # a batch's every prompt (or embedding input) is the engine's work
        if limits.max_prompt_tokens is not None and tokens > limits.max_prompt_tokens:
            param = endpoint.prompt_field
            what = "the prompt is" if len(lengths) == 1 else f"the {len(lengths)} prompts are"
            return body, error_body(f"{what} {tokens} tokens; this platform takes at most "
                                    f"{limits.max_prompt_tokens} prompt tokens per request", 400,
                                    param=param, code="prompt_too_long")
        return body, None

    async def ready(self, route: RouteHint | None = None) -> dict[str, Any]:
        """Answered only by a constructed replica, i.e. one that has served a real request."""
        return {
            "model": self.model.name,
            "version": self.version,
            "replica": self.replica_id,
            "pid": os.getpid(),
            "engine_pids": self.engine.process_ids(),
            "start": self.start_record,
            "cpu_cores": self._cores.cores if self._cores else None,
            "placement": self._group.describe() if self._group else None,
            "max_model_len": self.engine.max_model_len(),
            "dtype": self.engine.dtype(),
        }

    def stats(self, route: RouteHint | None = None) -> dict[str, Any]:
        """The engine's own view of this replica: load, prefix-cache counters. `route` may pin the call
        to one replica (`RouteHint(pin=replica_id)`)."""
        counters = self.engine.counters
        return {
            "replica": self.replica_id,
            "unfinished_requests": self.engine.num_unfinished_requests(),
            "prefix_cache_queries": counters.prefix_cache_queries if counters else 0,
            "prefix_cache_hits": counters.prefix_cache_hits if counters else 0,
            "kv_cache_usage": counters.kv_cache_usage if counters else 0.0,
            **_adapter_stats(self.engine, with_loads=True),
            **({"prefix_view": view.summary()} if (view := self.engine.prefix_view) else {}),
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Polled by Ray's autoscaler: the engine's own queue (waiting + running requests)."""
        return {ENGINE_REQUESTS_METRIC: float(self.engine.num_unfinished_requests())}

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Ray every `routing.stats_period_s`; the router bounds its picture of this replica's
        cache by the real KV capacity. Only what the routers read: Serve's controller broadcasts every
        replica's stats to every router in every gateway process whenever they differ from the last
        poll's, and each broadcast costs each router a rebuild of its replica set. A count of running
        requests was sent too, read by nobody: under load it changed at every poll, so every poll was a
        broadcast (in a 256-stream burst, handling broadcasts took 8% of the gateway's CPU)."""
        return {
            "kv_cache_blocks": self.engine.kv_cache_blocks(),
            "block_size": self.engine.block_size(),
            **_adapter_stats(self.engine),
            **(view.report() if (view := self.engine.prefix_view) is not None else {}),
        }

    def retire(self, route: RouteHint | None, within_s: float | None, not_before_s: float | None) -> dict[str, Any]:
        """An operator drains this replica (a pinned call; see shunter.deployments.gateway.replica_admin). From
        `not_before_s` on, once the engine holds no request or `within_s` has passed, the health check
        fails and Ray Serve replaces the replica, stopping it gracefully. `within_s` None cancels."""
        now = time.monotonic()
        self._retire = None if within_s is None else (now + (not_before_s or 0.0), now + within_s)
        log.warning("model %s version %s replica %s: %s", self.model.name, self.version, self.replica_id,
                    "retirement cancelled" if within_s is None else f"retires once idle, within {within_s:g}s")
        return {"replica": self.replica_id, "retiring": self._retire is not None,
                "unfinished_requests": self.engine.num_unfinished_requests()}

    async def check_health(self) -> None:
        """Ray Serve's periodic health check: raises when the engine core is dead, or when this replica
        retires (an operator drained it) and holds nothing more."""
        await self.engine.check_health()
        if self._retire is not None:
            not_before, latest = self._retire
            now, busy = time.monotonic(), self.engine.num_unfinished_requests()
            if now >= not_before and (busy == 0 or now >= latest):
                raise RuntimeError(f"replica {self.replica_id} retires: drained by an operator "
                                   f"({busy} request(s) unfinished)")

    def __del__(self) -> None:
        for name in ("_metrics_task", "_engine_watch"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        channel = getattr(self, "_channel", None)
        if channel is not None:
            channel.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - interpreter shutdown; nothing left to report to
                pass
        self._release_devices()

    def _release_devices(self) -> None:
        """Give back the cores (CPU) or the placement group this replica reserved (GPU, several stages)."""
        cores, group = getattr(self, "_cores", None), getattr(self, "_group", None)
        self._cores = self._group = None
        if cores is not None:
            cores.release()
        if group is not None:
            try:
                group.release()
            except Exception:  # noqa: BLE001 - Ray removes an actor's groups when it dies anyway
                log.warning("could not remove the engine's placement group", exc_info=True)


def _adapter_stats(engine: ServingEngine, with_loads: bool = False) -> dict[str, Any]:
    """The LoRA adapters the engine holds (least recently used first: the routers send an adapter's
    requests where it is held, `shunter.routing.state`), and `with_loads`, how often each was loaded."""
    adapters = engine.adapters
    if adapters is None:
        return {}
    held = {"adapters": adapters.held(), "adapter_capacity": adapters.capacity, "adapter_slots": adapters.slots}
    if with_loads:
        held.update(adapter_loads=dict(adapters.loads), adapter_load_seconds=adapters.load_seconds)
    return held


def _import_callable(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    return target
