"""The engine interface a ModelServer replica calls: every member it uses, declared in one place.

A replica (shunter.deployments.replica) owns one engine: `shunter.engine.VLLMEngine` in production, a
fake engine (tests/integration/fault_engine.py) only where a test injects faults through the replica's
`engine_factory` seam. The replica and its telemetry call the engine through `ServingEngine`, never by
probing it for attributes: an engine that lacks a member is refused when the replica starts
(`require_engine`), naming what it lacks, instead of failing on the first request that needs it.

`ServingEngine` is a `typing.Protocol`: VLLMEngine satisfies it structurally (it does not import this
module). Its members:

- the five endpoint calls, one per `shunter.endpoints.ENDPOINTS` name: `chat`, `completion`, `embedding`,
  `responses`, `messages`, each `async (body) -> EngineReply` (`shunter.engine.EngineReply`: a status with
  a JSON body or a stream of SSE text); each endpoint's descriptor names its call (`Endpoint.engine_call`);
- life and health: `warmup` (a real request end to end: a replica is ready only once it answered),
  `check_health` (raises when the engine is dead), `shutdown`;
- what the replica reads: `max_model_len`, `dtype` (None: not known), `num_unfinished_requests` (the
  autoscaler's and the drain's signal), `prompt_lengths` (the prompt limits; None: cannot be rendered),
  `kv_cache_blocks` and `block_size` (the router's bound on the replica's cache; 0: not known).

Optional capabilities, each None when the engine lacks it (read as attributes, so a replica tests for
None, never for the attribute's presence):

- `counters`: `shunter.engine.EngineCounters`, vLLM's scheduler stats (exported metrics, `stats`);
- `adapters`: `shunter.engine_lora.EngineAdapters`, when the engine serves LoRA adapters;
- `prefix_view`: `shunter.kv_events.EnginePrefixView`, when precise prefix routing follows its KV events;
- `progress`: `() -> int`, grows while the engine works: a heartbeat reports real progress, so a hung
  engine goes silent (None: every heartbeat says the replica works);
- `produced`: `(tally) -> (prompt, completion)`, the tokens a reply has produced so far
  (shunter.engine_usage): a whole reply's heartbeats and a stream's chunks carry them (None: they carry
  none, and a stream is counted at its final usage alone).

`BaseEngine` gives an engine these optional members' defaults (and `dtype`'s, `kv_cache_blocks`' and
`block_size`'s): a fake engine subclasses it and writes the required ones.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from shunter.engine import EngineCounters, EngineReply
    from shunter.engine_lora import EngineAdapters
    from shunter.engine_usage import Tally
    from shunter.kv_events import EnginePrefixView


@runtime_checkable
class ServingEngine(Protocol):
    """The engine a replica serves with; see the module docstring."""

    # ---- the endpoint calls (`Endpoint.engine_call`) -----------------------------------------------------

    async def chat(self, body: dict[str, Any]) -> EngineReply: ...

    async def completion(self, body: dict[str, Any]) -> EngineReply: ...

    async def embedding(self, body: dict[str, Any]) -> EngineReply: ...

    async def responses(self, body: dict[str, Any]) -> EngineReply: ...

    async def messages(self, body: dict[str, Any]) -> EngineReply: ...

    # ---- life and health --------------------------------------------------------------------------

    async def warmup(self) -> None:
        """A real request end to end; raises when it fails."""
        ...

    async def check_health(self) -> None:
        """Raises when the engine cannot serve any more."""
        ...

    def shutdown(self) -> None: ...

    # ---- what the replica reads ---------------------------------------------------------------------

    def max_model_len(self) -> int: ...

    def dtype(self) -> str | None:
        """The dtype the engine computes in; None when not known."""
        ...

    def num_unfinished_requests(self) -> int: ...

    def process_ids(self) -> list[int]:
        """The engine's own processes (its core and workers, however they were started); empty when it
        runs none of its own."""
        ...

    async def prompt_lengths(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """Prompt tokens of each prompt of a request; None (or empty) when the engine cannot render it."""
        ...

    def kv_cache_blocks(self) -> int:
        """KV blocks the engine allocated; 0 when not known."""
        ...

    def block_size(self) -> int:
        """Tokens per KV block; 0 when not known."""
        ...

    # ---- optional capabilities: None when the engine lacks them -------------------------------------

    @property
    def counters(self) -> EngineCounters | None: ...

    @property
    def adapters(self) -> EngineAdapters | None: ...

    @property
    def prefix_view(self) -> EnginePrefixView | None: ...

    @property
    def progress(self) -> Callable[[], int] | None: ...

    @property
    def produced(self) -> Callable[[Tally], tuple[int, int]] | None: ...

    @property
    def start_phases(self) -> dict[str, float] | None:
        """Seconds each step of the engine's start took (shunter.engine.START_PHASES), in order."""
        ...


class BaseEngine:
    """Defaults for `ServingEngine`'s optional members: no counters, no LoRA, no prefix view, no progress
    or token counts, an unknown dtype and KV cache. A subclass writes the required members."""

    counters: EngineCounters | None = None
    adapters: EngineAdapters | None = None
    prefix_view: EnginePrefixView | None = None
    progress: Callable[[], int] | None = None
    produced: Callable[[Tally], tuple[int, int]] | None = None
    start_phases: dict[str, float] | None = None

    def dtype(self) -> str | None:
        return None

    def kv_cache_blocks(self) -> int:
        return 0

    def block_size(self) -> int:
        return 0

    def process_ids(self) -> list[int]:
        return []


# The members, in declaration order: methods (called as declared) and the optional capabilities.
METHODS: tuple[str, ...] = tuple(
    name for name, value in vars(ServingEngine).items() if not name.startswith("_") and inspect.isfunction(value))
OPTIONAL: tuple[str, ...] = tuple(
    name for name, value in vars(ServingEngine).items() if not name.startswith("_") and isinstance(value, property))
# The parameters of an optional capability that is a call, when the engine has it.
OPTIONAL_CALLS: dict[str, tuple[str, ...]] = {"progress": (), "produced": ("tally",)}


def _parameters(member: Any) -> tuple[str, ...] | None:
    """A callable's parameter names, `self` left out (None when it has no readable signature)."""
    try:
        parameters = list(inspect.signature(member).parameters)
    except (TypeError, ValueError):
        return None
    return tuple(parameters[1:] if parameters[:1] == ["self"] else parameters)


def engine_problems(engine: Any) -> list[str]:
    """What keeps `engine` (an instance, or a class: then only its methods are checked, since optional
    capabilities may be set in `__init__`) from being a `ServingEngine`: each missing member, each method
    with other parameters than declared or not async where declared async (or the reverse), each
    optional call with other parameters. Empty: it is one."""
    problems: list[str] = []
    missing = [name for name in METHODS if not hasattr(engine, name)]
    if not isinstance(engine, type):
        missing += [name for name in OPTIONAL if not hasattr(engine, name)]
    if missing:
        problems.append("missing " + ", ".join(missing))
    for name in METHODS:
        if name in missing:
            continue
        declared, member = getattr(ServingEngine, name), getattr(engine, name)
        if not callable(member):
            problems.append(f"{name} is not a method")
            continue
        want, have = _parameters(declared), _parameters(member)
        if have is not None and have != want:
            problems.append(f"{name}({', '.join(have)}) takes other parameters than {name}({', '.join(want or ())})")
        if inspect.iscoroutinefunction(declared) != inspect.iscoroutinefunction(member):
            problems.append(f"{name} must {'' if inspect.iscoroutinefunction(declared) else 'not '}be async")
    for name, want in OPTIONAL_CALLS.items():
        member = getattr(engine, name, None)
        if name in missing or member is None or isinstance(member, property):
            continue
        if not callable(member):
            problems.append(f"{name} is neither None nor callable")
            continue
        have = _parameters(member)
        if have is not None and have != want:
            problems.append(f"{name}({', '.join(have)}) takes other parameters than {name}({', '.join(want)})")
    return problems


def require_engine(engine: Any) -> ServingEngine:
    """`engine`, checked to be a `ServingEngine`; TypeError naming what it lacks otherwise."""
    problems = engine_problems(engine)
    if problems:
        raise TypeError(f"{type(engine).__qualname__} is not a shunter.engine_protocol.ServingEngine: "
                        + "; ".join(problems))
    return engine
