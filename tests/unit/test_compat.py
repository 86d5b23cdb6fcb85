"""The private Ray and vLLM shapes `shunter.ray_compat` and `shunter.vllm_compat` rely on, one test per entry:
each fails naming the entry and the release it was checked against when the installed library no longer
has that shape (a class moved, a parameter renamed, an attribute no longer set). An upgrade of Ray or vLLM
runs these first; what they name is what to re-check. No Ray cluster, no engine: classes are imported,
inspected, and where cheap built and driven with stand-ins."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import re
from types import SimpleNamespace
from typing import Any, NoReturn

import pytest

from shunter import ray_compat, vllm_compat

pytestmark = pytest.mark.unit

RAY = f"ray {ray_compat.RAY_CHECKED}"
VLLM = f"vllm {vllm_compat.VLLM_CHECKED}"


def _broken(entry: str, checked: str, what: str) -> NoReturn:
    pytest.fail(f"{entry} (checked against {checked}) relies on a shape the installed library no longer has: "
                f"{what}. Re-check the entry (its docstring says why and what breaks) and its call sites.",
                pytrace=False)


def _expect(ok: object, entry: str, checked: str, what: str) -> None:
    if not ok:
        _broken(entry, checked, what)


def _params(func: Any) -> list[str]:
    return [p for p in inspect.signature(func).parameters if p != "self"]


def _source(obj: Any) -> str:
    return inspect.getsource(obj)


# ---- the modules themselves -----------------------------------------------------------------------------


def _entries(module: Any) -> dict[str, str]:
    """Every public top-level name the module defines (functions, classes, constants) and its docstring
    (a constant's is the string that follows it)."""
    import ast

    body = ast.parse(_source(module)).body
    found: dict[str, str] = {}
    for i, node in enumerate(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = ast.get_docstring(node) or ""
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            after = body[i + 1] if i + 1 < len(body) else None
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
            found[node.targets[0].id] = doc if isinstance(doc, str) else ""
    return {name: doc for name, doc in found.items() if not name.startswith("_")}


@pytest.mark.parametrize(("module", "checked"), [(ray_compat, RAY), (vllm_compat, VLLM)])
def test_every_entry_says_its_release_why_and_what_breaks(module, checked):
    entries = _entries(module)
    assert len(entries) > 5, entries
    for name, doc in entries.items():
        if name in ("RAY_CHECKED", "VLLM_CHECKED"):
            continue
        text = " ".join(doc.split()).lower()
        missing = [part for part in (f"checked against {checked}", "why", "what breaks") if part not in text]
        _expect(not missing, f"{module.__name__.removeprefix('shunter.')}.{name}", checked,
                f"its docstring does not say {', '.join(missing)}")


# ---- the releases themselves ---------------------------------------------------------------------------


def test_ray_is_the_release_ray_compat_was_checked_against():
    import ray

    _expect(ray.__version__ == ray_compat.RAY_CHECKED, "shunter.ray_compat", RAY,
            f"ray {ray.__version__} is installed; run this file, re-check every entry, then set RAY_CHECKED")


def test_vllm_is_the_release_vllm_compat_was_checked_against():
    import vllm

    installed = vllm.__version__.split("+")[0]  # a build's local tag (+cpu, +cu128) is the same release
    _expect(installed == vllm_compat.VLLM_CHECKED, "shunter.vllm_compat", VLLM,
            f"vllm {vllm.__version__} is installed; run this file, re-check every entry, then set VLLM_CHECKED")


# ---- ray_compat ------------------------------------------------------------------------------------------


def _router(cls: type | None = None, **kwargs: Any) -> Any:
    """A Ray request router built as Serve builds one, without a cluster (needs a running event loop)."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    cls = cls or ray_compat.power_of_two_router()
    return cls(deployment_id=DeploymentID(name="dep", app_name="app"),
               handle_source=DeploymentHandleSource.UNKNOWN, **kwargs)


def test_power_of_two_router():
    entry = "ray_compat.power_of_two_router / POWER_OF_TWO_ROUTER"
    try:
        router = ray_compat.power_of_two_router()
    except (ImportError, AttributeError) as exc:
        _broken(entry, RAY, f"{ray_compat.POWER_OF_TWO_ROUTER} does not import ({exc})")
    from ray.serve.request_router import RequestRouter

    _expect(isinstance(router, type) and issubclass(router, RequestRouter), entry, RAY,
            "it is no longer a subclass of the public RequestRouter")
    _expect(inspect.iscoroutinefunction(router.choose_replicas)
            and _params(router.choose_replicas)[:2] == ["candidate_replicas", "pending_request"], entry, RAY,
            f"choose_replicas is not `async (candidate_replicas, pending_request)`: "
            f"{inspect.signature(router.choose_replicas)}")


def test_router_deployment():
    from ray.serve._private.request_router.request_router import RequestRouter

    entry = "ray_compat.router_deployment"
    _expect(_params(RequestRouter.__init__)[:2] == ["deployment_id", "handle_source"], entry, RAY,
            f"RequestRouter.__init__ is {inspect.signature(RequestRouter.__init__)}")
    _expect("self._deployment_id = deployment_id" in _source(RequestRouter.__init__), entry, RAY,
            "RequestRouter.__init__ no longer sets self._deployment_id")

    async def built() -> tuple[str, str]:
        return ray_compat.router_deployment(_router())

    try:
        names = asyncio.run(built())
    except AttributeError as exc:
        _broken(entry, RAY, f"reading the router's deployment failed: {exc}")
    _expect(names == ("app", "dep"), entry, RAY, f"a router of app/dep reads {names}")


def test_shunters_guarded_routers_start_on_rays_router():
    """The guard's initialize_state finds its deployment through router_deployment, on Ray's own router."""
    from shunter.routing.routers import PowerOfTwoRouter

    async def started() -> Any:
        router = _router(PowerOfTwoRouter)
        router.initialize_state(shunter={"model": "compat-model"})
        return router._shunter

    state = asyncio.run(started())
    _expect(state.model == "compat-model", "ray_compat.router_deployment", RAY, "the guard did not start")


def test_cached_queue_len():
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve._private.request_router.request_router import RequestRouter

    entry = "ray_compat.cached_queue_len"
    _expect("self._replica_queue_len_cache = " in _source(RequestRouter.__init__), entry, RAY,
            "RequestRouter.__init__ no longer sets self._replica_queue_len_cache")
    replica = ReplicaID(unique_id="r1", deployment_id=DeploymentID(name="dep", app_name="app"))

    async def read() -> tuple[Any, Any]:
        router = _router(use_replica_queue_len_cache=True)
        before = ray_compat.cached_queue_len(router, replica)
        router.on_new_queue_len_info(replica, 3)  # what Ray calls with a replica's report
        return before, ray_compat.cached_queue_len(router, replica)

    try:
        before, after = asyncio.run(read())
    except (AttributeError, TypeError) as exc:
        _broken(entry, RAY, f"reading the queue-length cache failed: {exc}")
    _expect(before is None and after == 3, entry, RAY,
            f"the cache read {before!r} before any report and {after!r} after a report of 3 (want None, 3)")


def test_request_notes():
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    entry = "ray_compat.request_note / set_request_note"
    _expect(dataclasses.is_dataclass(PendingRequest) and not PendingRequest.__dataclass_params__.frozen
            and "__slots__" not in vars(PendingRequest), entry, RAY,
            "PendingRequest is no longer a plain mutable dataclass without slots: notes cannot be set on it")

    async def noted() -> tuple[Any, Any]:
        pending = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(request_id="a", internal_request_id="b"))
        ray_compat.set_request_note(pending, "key", "k")
        return ray_compat.request_note(pending, "key"), ray_compat.request_note(pending, "most", 7)

    _expect(asyncio.run(noted()) == ("k", 7), entry, RAY, "a note set on a PendingRequest does not read back")
    # One PendingRequest object goes to choose_replicas (via _choose_replica_for_request) and on_request_routed.
    from ray.serve._private import router

    source = _source(router)
    _expect(re.search(r"_choose_replica_for_request\(\s*pr\b", source)
            and re.search(r"on_request_routed\(\s*pr\b", source), entry, RAY,
            "Ray's router no longer hands the same PendingRequest (`pr`) to routing and to on_request_routed")


@pytest.mark.parametrize(("entry", "private", "params"), [
    ("ray_compat.kv_get", "_internal_kv_get", ["key", "namespace"]),
    ("ray_compat.kv_put", "_internal_kv_put", ["key", "value", "overwrite", "namespace"]),
    ("ray_compat.kv_keys", "_internal_kv_list", ["prefix", "namespace"]),
])
def test_kv_store(entry, private, params):
    from ray.experimental import internal_kv

    call = getattr(internal_kv, private, None)
    _expect(callable(call), entry, RAY, f"ray.experimental.internal_kv.{private} is gone")
    _expect(_params(call) == params, entry, RAY, f"{private} is {inspect.signature(call)}, not ({', '.join(params)})")
    _expect(inspect.signature(call).parameters["namespace"].kind is inspect.Parameter.KEYWORD_ONLY, entry, RAY,
            f"{private}'s namespace is no longer keyword-only")


def test_serve_http_host():
    from ray.serve import context
    from ray.serve._private.client import ServeControllerClient
    from ray.serve.config import HTTPOptions

    entry = "ray_compat.serve_http_host"
    client = getattr(context, "_get_global_client", None)
    _expect(callable(client), entry, RAY, "ray.serve.context._get_global_client is gone")
    _expect(all(p.default is not inspect.Parameter.empty for p in inspect.signature(client).parameters.values()),
            entry, RAY, f"_get_global_client needs arguments: {inspect.signature(client)}")
    _expect(isinstance(inspect.getattr_static(ServeControllerClient, "http_config", None), property), entry, RAY,
            "ServeControllerClient.http_config is no longer a property")
    _expect("host" in HTTPOptions.model_fields, entry, RAY, "HTTPOptions has no `host` field")


def test_serve_request_id():
    from ray.serve import context

    entry = "ray_compat.serve_request_id"
    _expect(callable(getattr(context, "_get_serve_request_context", None)), entry, RAY,
            "ray.serve.context._get_serve_request_context is gone")
    _expect("request_id" in {f.name for f in dataclasses.fields(context._get_serve_request_context())}, entry, RAY,
            "Serve's request context has no request_id field")
    _expect(ray_compat.serve_request_id() == "", entry, RAY,
            f"outside a request the id reads {ray_compat.serve_request_id()!r}, not ''")


def test_init_metrics_port():
    import ray
    from ray._private import worker

    entry = "ray_compat.init_metrics_port"
    _expect(ray.init is worker.init and 'kwargs.pop("_metrics_export_port"' in _source(worker.init), entry, RAY,
            "ray.init no longer takes _metrics_export_port from its keyword arguments")
    _expect(ray_compat.init_metrics_port(None) == {} and ray_compat.init_metrics_port(9) == {"_metrics_export_port": 9},
            entry, RAY, "the keyword arguments it makes changed")


# ---- vllm_compat ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "params", "callers"), [
    ("generate", ["prompt", "sampling_params", "request_id"],
     ["vllm.entrypoints.openai.chat_completion.serving", "vllm.entrypoints.openai.completion.serving",
      "vllm.entrypoints.openai.responses.serving"]),
    ("encode", ["prompt", "pooling_params", "request_id"], ["vllm.entrypoints.pooling.base.serving"]),
])
def test_wrap_engine_call(name, params, callers):
    import importlib

    from vllm.v1.engine.async_llm import AsyncLLM

    entry = f"vllm_compat.wrap_engine_call({name!r})"
    call = getattr(AsyncLLM, name)
    _expect(inspect.isasyncgenfunction(call), entry, VLLM, f"AsyncLLM.{name} is no longer an async generator")
    _expect(_params(call)[:3] == params and "lora_request" in _params(call), entry, VLLM,
            f"AsyncLLM.{name} is {inspect.signature(call)}: the wrappers read request_id as the third "
            "argument and lora_request by keyword")
    for module in callers:
        _expect(f"self.engine_client.{name}(" in _source(importlib.import_module(module)), entry, VLLM,
                f"{module} no longer submits through self.engine_client.{name}")
    engine = SimpleNamespace(**{name: lambda *a, **k: "called"})
    vllm_compat.wrap_engine_call(engine, name, lambda call: lambda *a, **k: ("wrapped", call(*a, **k)))
    assert getattr(engine, name)() == ("wrapped", "called")
    with pytest.raises(ValueError):
        vllm_compat.wrap_engine_call(engine, "abort", lambda call: call)


def test_output_processor_and_request_progress():
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState

    entry = "vllm_compat.output_processor / request_progress"
    _expect("self.output_processor = OutputProcessor(" in _source(AsyncLLM.__init__), entry, VLLM,
            "AsyncLLM no longer keeps its OutputProcessor as self.output_processor")
    processor = OutputProcessor(None, log_stats=False)
    _expect(processor.request_states == {} and isinstance(processor.external_req_ids, collections.defaultdict),
            entry, VLLM, "OutputProcessor no longer has request_states and external_req_ids")
    _expect("self.external_req_ids[" in _source(OutputProcessor.add_request), entry, VLLM,
            "OutputProcessor.add_request no longer files engine ids under their external id")
    _expect("self.prompt_len = " in _source(RequestState) and "detokenizer" in _params(RequestState.__init__),
            entry, VLLM, "RequestState no longer has prompt_len and detokenizer")
    _expect(_params(IncrementalDetokenizer.num_output_tokens) == [], entry, VLLM,
            "IncrementalDetokenizer.num_output_tokens() is gone or takes arguments")
    processor.request_states["e1"] = SimpleNamespace(prompt_len=5, detokenizer=SimpleNamespace(num_output_tokens=lambda: 2))
    processor.request_states["e2"] = SimpleNamespace(prompt_len=5, detokenizer=None)
    processor.external_req_ids["x"] += ["e1", "e2", "gone"]
    assert vllm_compat.request_progress(processor, "x") == [("e1", 5, 2), ("e2", 5, None)]
    assert vllm_compat.request_progress(processor, "y") == []
    assert vllm_compat.output_processor(SimpleNamespace(output_processor=processor)) is processor


def test_wrap_error_responses():
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
    from vllm.entrypoints.pooling.embed.serving import ServingEmbedding
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.engine.serving import BaseServing

    entry = "vllm_compat.wrap_error_responses"
    _expect(_params(BaseServing.create_error_response) == ["message", "err_type", "status_code", "param"], entry,
            VLLM, f"BaseServing.create_error_response is {inspect.signature(BaseServing.create_error_response)}")
    for handler in (OpenAIServingChat, OpenAIServingCompletion, OpenAIServingResponses, AnthropicServingMessages,
                    ServingEmbedding):
        _expect(issubclass(handler, BaseServing), entry, VLLM, f"{handler.__name__} is no longer a BaseServing")
    seen: list[Any] = []

    def noting(create: Any) -> Any:
        return lambda message, *a, **k: seen.append(message) or create(message, *a, **k)

    chat = object.__new__(OpenAIServingChat)
    assert vllm_compat.wrap_error_responses(chat, noting)
    boom = ValueError("boom")
    _expect(isinstance(chat.create_error_response(boom), ErrorResponse), entry, VLLM,
            "create_error_response no longer answers an exception with an ErrorResponse")
    chat.create_streaming_error_response(boom)  # a stream's error event: through the instance's method too
    _expect(seen == [boom, boom], entry, VLLM, "a stream's error event no longer passes through "
            "self.create_error_response")
    assert not vllm_compat.wrap_error_responses(SimpleNamespace(), noting)


def test_carry_messages_priority():
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    entry = "vllm_compat.carry_messages_priority"
    _expect("self.to_chat_completion_request(" in _source(AnthropicServingMessages.create_messages), entry, VLLM,
            "create_messages no longer converts its request through self.to_chat_completion_request")
    _expect("priority" in ChatCompletionRequest.model_fields, entry, VLLM, "ChatCompletionRequest has no priority")
    handler = object.__new__(AnthropicServingMessages)
    vllm_compat.carry_messages_priority(handler)
    request = AnthropicMessagesRequest(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with vllm_compat.messages_priority(2):
        _expect(handler.to_chat_completion_request(request).priority == 2, entry, VLLM,
                "the converted chat request does not keep the priority set on it")
    assert handler.to_chat_completion_request(request).priority == 0, "outside the call: vLLM's default"
    assert AnthropicServingMessages.to_chat_completion_request(request).priority == 0, "other handlers untouched"


def test_engine_core_processes():
    import vllm.v1.engine.utils as engine_utils
    import vllm.v1.utils as v1_utils
    from vllm.v1.engine.utils import CoreEngineProcManager

    entry = "vllm_compat.engine_core_processes"
    source = _source(CoreEngineProcManager)
    _expect("get_mp_context()" in source and "context.Process(" in source
            and "target=EngineCoreProc.run_engine_core" in source, entry, VLLM,
            "CoreEngineProcManager no longer starts its cores with get_mp_context().Process(target=EngineCoreProc"
            ".run_engine_core, ...)")
    # What it and vllm.v1.utils.shutdown use of a process: shunter.engine_forkserver.ForkedProcess has each.
    used = _source(engine_utils) + _source(v1_utils.shutdown)
    import re

    from shunter.engine_forkserver import ForkedProcess

    members = set(re.findall(r"\bproc\.(\w+)", used))
    _expect({"sentinel", "exitcode", "start"} <= members, entry, VLLM, "the process manager no longer watches "
            "each process's sentinel and exit code")
    lacking = {m for m in members if not hasattr(ForkedProcess, m) and m not in ("pid", "name", "daemon")}
    _expect(not lacking, entry, VLLM, f"the process manager uses members ForkedProcess lacks: {sorted(lacking)}")
    original, context = engine_utils.get_mp_context, object()
    with vllm_compat.engine_core_processes(context):
        _expect(engine_utils.get_mp_context() is context, entry, VLLM, "the context was not put in place")
    _expect(engine_utils.get_mp_context is original, entry, VLLM, "vLLM's own context was not given back")


def test_prompt_len():
    from vllm.entrypoints.serve.engine.serving import BaseServing
    from vllm.inputs import tokens_input

    entry = "vllm_compat.prompt_len"
    _expect(callable(getattr(BaseServing, "_extract_prompt_len", None))
            and _params(BaseServing._extract_prompt_len) == ["prompt"], entry, VLLM,
            "BaseServing._extract_prompt_len(prompt) is gone or changed")
    handler = object.__new__(BaseServing)
    handler.model_config = SimpleNamespace(is_encoder_decoder=False)
    _expect(vllm_compat.prompt_len(handler, tokens_input([1, 2, 3])) == 3, entry, VLLM,
            "a three-token engine input does not count 3")


def test_render_responses_input():
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
    from vllm.renderers.online_renderer import ResponsesRenderResult

    entry = "vllm_compat.render_responses_input"
    render = getattr(OpenAIServingResponses, "_render_resolved_response_inputs", None)
    _expect(inspect.iscoroutinefunction(render) and _params(render)[:2] == ["request", "prev_response"], entry,
            VLLM, "OpenAIServingResponses._render_resolved_response_inputs(request, prev_response) is gone or "
                  "changed")
    _expect("engine_input" in {f.name for f in dataclasses.fields(ResponsesRenderResult)}, entry, VLLM,
            "ResponsesRenderResult has no engine_input")
    handler = object.__new__(OpenAIServingResponses)
    asked: list[Any] = []

    async def render_responses(request: Any, **kwargs: Any) -> Any:
        asked.append((request, kwargs.get("previous_messages"), kwargs.get("previous_response_outputs")))
        return ResponsesRenderResult(messages=[], engine_input="the input")

    handler.online_renderer = SimpleNamespace(render_responses=render_responses)
    handler.tool_server = None
    got = asyncio.run(vllm_compat.render_responses_input(handler, "the request"))
    _expect(got == "the input" and asked == [("the request", None, None)], entry, VLLM,
            f"a stateless request rendered as {asked}, giving {got!r}")


def test_lora_registry_and_serve_lora():
    from vllm.entrypoints.openai.models.serving import BaseModelPath, OpenAIServingModels
    from vllm.entrypoints.serve.engine.serving import BaseServing

    entry = "vllm_compat.lora_registry / serve_lora"
    source = _source(OpenAIServingModels.__init__)
    _expect("self.lora_requests" in source and "self.lora_id_counter = AtomicCounter(" in source, entry, VLLM,
            "OpenAIServingModels no longer keeps lora_requests and lora_id_counter")
    client = SimpleNamespace(model_config=None, renderer=None, input_processor=None)
    models = OpenAIServingModels(client, [BaseModelPath(name="base", model_path="/base")])
    vllm_compat.serve_lora(models, "a", "/a1", "base")
    vllm_compat.serve_lora(models, "b", "/b", "base", lora_id=9)
    vllm_compat.serve_lora(models, "a", "/a2", "base")
    registry = vllm_compat.lora_registry(models)
    _expect({n: (r.lora_int_id, r.lora_path, r.base_model_name) for n, r in registry.items()}
            == {"a": (2, "/a2", "base"), "b": (9, "/b", "base")}, entry, VLLM,
            f"the registry holds {registry}: a new id per new files, the given one kept")
    handler = object.__new__(BaseServing)
    handler.request_logger, handler.models = None, models
    _expect(asyncio.run(handler._check_model(SimpleNamespace(model="a"))) is None, entry, VLLM,
            "vLLM's handlers no longer accept a model named in OpenAIServingModels.lora_requests")
    registry.pop("a")
    _expect(asyncio.run(handler._check_model(SimpleNamespace(model="a"))) is not None, entry, VLLM,
            "vLLM's handlers still accept an adapter removed from OpenAIServingModels.lora_requests")


def test_engine_arg_names_and_quantization_methods_read_from_source_are_vllms_own():
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    read, live = vllm_compat.engine_arg_names(), {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    _expect(read and read == live, "vllm_compat.engine_arg_names", VLLM,
            f"the AsyncEngineArgs fields read from vLLM's source ({len(read)}) are not its dataclass fields "
            f"({len(live)}): {sorted(read ^ live)[:8]}")
    read, live = vllm_compat.quantization_methods(), set(QUANTIZATION_METHODS)
    _expect(read and read == live, "vllm_compat.quantization_methods", VLLM,
            f"the quantization methods read from vLLM's source are not QUANTIZATION_METHODS: {sorted(read ^ live)}")


def test_registered_parser_names():
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    entry = "vllm_compat.registered_parser_names"
    for kind, manager in (("tool_call_parser", ToolParserManager), ("reasoning_parser", ReasoningParserManager)):
        read, registered = vllm_compat.registered_parser_names(kind), set(manager.list_registered())
        _expect(read and read == registered, entry, VLLM,
                f"the {kind} names read from vLLM's source ({len(read)}) are not those it registers "
                f"({len(registered)}): {sorted(read ^ registered)[:8]}")


def test_fix_cpu_lora_base_rows():
    """vLLM's CPU shrink op reads the no-LoRA slot -1 as the last adapter's (the bug the entry mends), and
    after the entry a token at -1 gets a zero row (no LoRA delta) while the others keep theirs."""
    import importlib

    import torch

    entry = "vllm_compat.fix_cpu_lora_base_rows"
    ops = importlib.import_module("vllm.lora.ops.torch_ops.lora_ops")
    _expect(_params(ops.bgmv_shrink)[:4] == ["inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor"],
            entry, VLLM, "bgmv_shrink(inputs, weights, output, indices, scaling) changed")
    for holder in ("vllm.lora.ops.torch_ops", "vllm.lora.punica_wrapper.punica_cpu"):
        _expect(callable(getattr(importlib.import_module(holder), "bgmv_shrink", None)), entry, VLLM,
                f"{holder} no longer holds bgmv_shrink")
    inputs = torch.ones(2, 4)
    weights = torch.stack([torch.full((1, 3, 4), 1.0), torch.full((1, 3, 4), 2.0)])  # two slots, rank 3
    indices = torch.tensor([-1, 0])

    def shrink() -> torch.Tensor:
        out = torch.full((2, 3), 7.0)
        importlib.import_module("vllm.lora.ops.torch_ops.lora_ops").bgmv_shrink(inputs, weights, out, indices, 1.0)
        return out

    if not getattr(ops.bgmv_shrink, "_shunter_base_rows", False):
        _expect(shrink()[0].tolist() == [8.0, 8.0, 8.0], entry, VLLM,
                "slot -1 no longer reads the last adapter: vLLM fixed it, and the entry can go")
        assert vllm_compat.fix_cpu_lora_base_rows()
    assert not vllm_compat.fix_cpu_lora_base_rows(), "applied once per process"
    mended = shrink()
    assert mended[0].tolist() == [0.0, 0.0, 0.0] and mended[1].tolist() == [4.0, 4.0, 4.0]
    from vllm.lora.punica_wrapper import punica_cpu

    assert punica_cpu.bgmv_shrink is ops.bgmv_shrink  # the CPU wrapper calls the mended op
