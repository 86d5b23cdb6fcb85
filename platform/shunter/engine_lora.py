"""The LoRA adapters of one replica's engine: which it serves, which it holds, loading them.

vLLM loads an adapter inside its engine core the first time a scheduled request names it, and keeps the
most recently used (`max_cpu_loras` in host memory, `max_loras` of those in a batch). Two things are
missing there for a platform: an adapter whose files fail to load kills the engine core in the middle of
a batch (every request of the replica with it), and nothing outside the engine knows which adapters it
holds. So an adapter the engine does not hold is first loaded through the engine's own `add_lora` call,
whose failure is a 422 for that request alone, and this class keeps a copy of the engine's LRU: the
routers read it (routing stats) to send an adapter's requests where it is loaded already, and the loads
are counted and timed.

The copy follows every request for an adapter, the way the engine's cache does; where the two differ
(the engine touches an adapter at each step, not once per request) the engine reloads an adapter by
itself, uncounted, from files that loaded once already.

Adapters come from the model's config and, while the replica runs, from the admin API (`register`,
`unregister`); an adapter given new files gets a new engine id, so old weights are never served. An
adapter in an object store is fetched to the node on its first load (`shunter.lora_sources`).
Like engine.py, this imports vLLM only inside functions; the serving layer's adapter registry is
private to vLLM and changed through `shunter.vllm_compat`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

from shunter import vllm_compat
from shunter.errors import error_body
from shunter.lora_sources import AdapterSourceError, fetch, is_remote

log = logging.getLogger(__name__)


class AdapterUnavailable(Exception):
    """An adapter this replica cannot serve; `body` is the 422 the request gets."""

    def __init__(self, name: str, base: str, why: str):
        super().__init__(why)
        # A 4xx, not a 5xx: the replica is healthy, the adapter is not (a 5xx would count against the
        # replica's breaker and fail the request over to replicas that cannot load it either).
        self.body = error_body(f"adapter {name!r} of model {base!r} cannot be loaded: {why}; an operator must "
                               "fix or remove it", 422, param="model", code="adapter_unavailable")


class EngineAdapters:
    """`engine`: vLLM's AsyncLLM; `models`: its OpenAIServingModels (whose registry of the adapter names
    vLLM's handlers accept is changed through `shunter.vllm_compat`); `capacity`: the adapters the engine
    keeps in host memory; `slots`: the adapters one batch may mix (`max_loras`: vLLM's scheduler holds
    back a request for another adapter while that many run)."""

    def __init__(self, engine: Any, models: Any, base: str, capacity: int,
                 adapters: Iterable[tuple[str, str]] = (), slots: int | None = None):
        self._engine = engine
        self._models = models
        self.base = base
        self.capacity = capacity
        self.slots = slots or capacity
        self._paths: dict[str, str] = {}
        self._held: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._locks: dict[str, asyncio.Lock] = {}
        self.loads: Counter[str] = Counter()  # adapter -> loads on this replica
        self.load_seconds = 0.0  # all loads together
        for name, path in adapters:
            self.register(name, path)

    def serves(self, name: Any) -> bool:
        return isinstance(name, str) and name in self._paths

    def held(self) -> list[str]:
        """The adapters the engine holds, least recently used first."""
        return list(self._held)

    def register(self, name: str, path: str) -> bool:
        """Serve `name` from `path`, without loading it: a new adapter, or new files for a known one.
        False when it was served from `path` already."""
        if self._paths.get(name) == path:
            return False
        old = vllm_compat.lora_registry(self._models).get(name)
        self._paths[name] = path
        vllm_compat.serve_lora(self._models, name, path, self.base)  # a new engine id: new weights
        if old is not None:
            self._forget(name, old.lora_int_id)
        return True

    def unregister(self, name: str) -> bool:
        """Stop serving `name`; the engine drops its weights. False when it was not served."""
        if self._paths.pop(name, None) is None:
            return False
        old = vllm_compat.lora_registry(self._models).pop(name, None)
        if old is not None:
            self._forget(name, old.lora_int_id)
        return True

    async def _fetch(self, name: str, source: str) -> None:
        """Serve remote adapter `name` from the node's copy of its files, fetching them first if the node
        has none (in a thread: other requests of the replica go on meanwhile)."""
        request = vllm_compat.lora_registry(self._models)[name]
        if request.lora_path != source:
            return  # fetched before
        try:
            local = await asyncio.to_thread(fetch, source)
        except AdapterSourceError as exc:
            log.warning("adapter %s of %s could not be fetched: %s", name, self.base, exc)
            raise AdapterUnavailable(name, self.base, str(exc)) from None
        if self._paths.get(name) == source:  # not re-registered or removed meanwhile
            vllm_compat.serve_lora(self._models, name, local, self.base, lora_id=request.lora_int_id)

    def _forget(self, name: str, lora_id: int) -> None:
        """The engine drops the weights of `lora_id` (between steps: a request running keeps them). Asked
        even where the copy says it holds none: the copy may have let go first."""
        self._held.pop(name, None)
        task = asyncio.get_running_loop().create_task(self._engine.remove_lora(lora_id))
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or log.warning(
            "adapter %s of %s: dropping its old weights failed: %s", name, self.base, t.exception()))

    async def ready(self, name: Any) -> None:
        """Returns once the engine holds adapter `name` (loading it now if it does not); nothing for the
        base model. Raises AdapterUnavailable when the adapter cannot be loaded."""
        if not self.serves(name):
            return
        path = self._paths[name]
        if not is_remote(path) and not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise AdapterUnavailable(name, self.base, f"its files are gone from {path}")
        if name in self._held:
            self._held.move_to_end(name)
            return
        async with self._locks.setdefault(name, asyncio.Lock()):  # one load per adapter at a time
            if name in self._held:
                self._held.move_to_end(name)
                return
            started = time.perf_counter()
            if is_remote(path):
                await self._fetch(name, path)
            request = vllm_compat.lora_registry(self._models)[name]
            try:
                await self._engine.add_lora(request)
            except Exception as exc:  # noqa: BLE001 - the engine's reason, reported to the caller
                log.warning("adapter %s of %s could not be loaded: %s", name, self.base, exc)
                raise AdapterUnavailable(name, self.base, f"{type(exc).__name__}: {exc}"[:300]) from None
            took = time.perf_counter() - started
            if self._paths.get(name) != path:  # re-registered or removed while it loaded
                return
            self.loads[name] += 1
            self.load_seconds += took
            self._held[name] = None
            while len(self._held) > self.capacity:  # the engine evicted its least recently used
                self._held.popitem(last=False)
            log.info("adapter %s of %s loaded in %.3fs", name, self.base, took)
