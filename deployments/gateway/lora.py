"""The LoRA adapters a gateway serves now: those found in each model's `adapter_dirs` (scanned every
SCAN_EVERY_S), its configured `adapters` over them, and an operator's additions and removals through the
admin API on top (kept in the cluster's control state, so every gateway replica sees them within a
second: `shunter.deployments.gateway.traffic` reads it).

A request names an adapter by its own name or as `<model>:<adapter>` (the model by its name or an
alias). The gateway hands the replica the adapter's directory with each request for it, so a replica
serves an adapter added after it started without being told anything else (`shunter.engine_lora`).

An adapter can roll out to new files (its version 2) the way a model rolls out to a new version: the
control actor runs the same state machine (steps, holds, gates; `shunter.ops.rollout`) under the key
`<model>@<adapter>`, and while it runs, each request for the adapter goes to one of its two versions by
the live weights (a conversation keeps its version, as for models). A version is named by a digest of
its directory. Nothing has to start: a replica loads either version when first asked; on promotion the
adapter's directory becomes the new one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shunter.config import ModelConfig, ShunterConfig
from shunter.config.adapters import AdapterConfig, adapter_name_problem
from shunter.errors import ApiError
from shunter.ops.control import adapter_changes
from shunter.ops.rollout import Phase
from shunter.replica_protocol import AdapterRoute
from shunter.routing.versions import choose_version

log = logging.getLogger("ray.serve")

# Adapters one model may serve, config and admin API together: it bounds the `adapter` label of the
# metrics (shunter.metric_catalog) as well as the gateway's and replicas' tables.
MAX_ADAPTERS_PER_MODEL = 1000
SCAN_EVERY_S = 10.0  # how often `adapter_dirs` are listed again


@dataclass(frozen=True)
class Adapter:
    base: ModelConfig
    name: str
    source: str
    origin: str  # "config" | "scan" (found in adapter_dirs) | "admin"

    def card(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.base.name, "source": self.source, "origin": self.origin,
                "version": version_label(self.source)}

    @property
    def rollout_key(self) -> str:
        return rollout_key(self.base.name, self.name)


def rollout_key(model: str, adapter: str) -> str:
    """An adapter's rollouts' key in the control state (`@` is in no model name)."""
    return f"{model}@{adapter}"


def version_label(source: str) -> str:
    """An adapter version's name: a digest of its directory."""
    return hashlib.blake2b(source.encode(), digest_size=4).hexdigest()


@dataclass(frozen=True)
class _Split:
    weights: tuple[tuple[str, float], ...]  # version label -> traffic weight, the incoming version first
    sources: dict[str, str]  # version label -> directory


class LiveAdapters:
    def __init__(self, config: ShunterConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._scanned: dict[str, dict[str, str]] = {}  # model -> what its adapter_dirs held at the last scan
        self._scanned_at: float | None = None
        self._skipped: set[str] = set()  # directories already warned about
        self._by_model: dict[str, dict[str, Adapter]] = {}
        self._by_name: dict[str, Adapter] = {}
        self._splits: dict[str, _Split] = {}  # rollout key -> the traffic split of a rollout under way
        self.refresh({})

    def refresh(self, state: dict[str, Any]) -> None:
        """The control state was read: apply the operators' changes over the config (a new table is
        swapped in whole, so a request never sees half of it)."""
        now = self._clock()
        if self._scanned_at is None or now - self._scanned_at >= SCAN_EVERY_S:
            self._scanned_at = now
            self._scanned = {m.name: self._scan(m) for m in self.config.models if m.adapter_dirs}
        by_model: dict[str, dict[str, Adapter]] = {}
        for model in self.config.models:
            if not model.lora:
                continue
            table = {name: Adapter(model, name, source, "scan") for name, source in self._scanned.get(model.name, {}).items()}
            table.update({a.name: Adapter(model, a.name, a.source, "config") for a in model.adapters})
            for name, source in adapter_changes(state, model.name, model.adapters_fingerprint()).items():
                if source is None:
                    table.pop(name, None)
                elif (problem := adapter_name_problem(name)) is not None:  # saved before names were checked
                    self._skip(f"adapter {name!r} of model {model.name}", problem, "admin API")
                else:
                    table[name] = Adapter(model, name, source, "admin")
            by_model[model.name] = table
        self._by_model = by_model
        self._by_name = {name: a for table in by_model.values() for name, a in table.items()}
        self._splits = self._read_splits(state)

    def _read_splits(self, state: dict[str, Any]) -> dict[str, _Split]:
        splits = {}
        for key, entry in (state.get("rollouts") or {}).items():
            context = entry.get("context") or {}
            adapter = self._by_name.get(context.get("adapter", ""))
            if adapter is None or adapter.rollout_key != key or entry["rollout"]["phase"] == Phase.DONE.value:
                continue
            if context.get("fingerprint") != adapter.base.adapters_fingerprint():
                continue  # the config's adapters changed since: it starts from the file again
            live = (state.get("models") or {}).get(key) or {}
            weights = tuple((v, float(w)) for v, w in live.get("weights") or context["file_weights"])
            splits[key] = _Split(weights, dict(context["sources"]))
        return splits

    def route(self, adapter: Adapter, session: str | None) -> AdapterRoute:
        """Where a request for `adapter` goes: its files, or under a rollout, one version's by the weights."""
        split = self._splits.get(adapter.rollout_key)
        if split is None:
            return AdapterRoute(adapter.name, adapter.source, adapter.name)
        version = choose_version(adapter.rollout_key, split.weights, session)
        source = split.sources[version]
        engine_name = adapter.name if source == adapter.source else f"{adapter.name}@{version}"
        return AdapterRoute(adapter.name, source, engine_name, version)

    def rolling_out(self, adapter: Adapter) -> bool:
        return adapter.rollout_key in self._splits

    def rollout_context(self, adapter: Adapter, source: str) -> dict[str, Any]:
        """What the control actor needs to roll `adapter` out to the files in `source` (see
        `LiveVersions.context` for a model's)."""
        old, new = version_label(adapter.source), version_label(source)
        return {"model": adapter.rollout_key, "adapter": adapter.name, "base": adapter.base.name,
                "fingerprint": adapter.base.adapters_fingerprint(), "versions": [old, new],
                "file_weights": [[old, 100.0]], "sources": {old: adapter.source, new: source},
                "deployments": {}, "ready_replicas": 0, "rollout": adapter.base.rollout.model_dump(mode="json")}

    def _scan(self, model: ModelConfig) -> dict[str, str]:
        """The adapters in `model`'s adapter_dirs: name -> directory. A subdirectory whose name cannot be an
        adapter's, or is another model's or adapter's, or whose rank the engine cannot take, is skipped
        (with one warning)."""
        others = {n for m in self.config.models for n in m.names} | {
            a.name for m in self.config.models if m is not model for a in m.adapters}
        found: dict[str, str] = {}
        known = self._scanned.get(model.name, {})  # checked at an earlier scan: not read again
        for folder in model.adapter_dirs:
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError as exc:
                self._skip(folder, f"cannot be listed: {exc}")
                continue
            for entry in entries:
                if not os.path.isfile(os.path.join(entry.path, "adapter_config.json")) or entry.name in found:
                    continue
                if known.get(entry.name) == entry.path:
                    found[entry.name] = entry.path
                    continue
                name_problem = adapter_name_problem(entry.name)
                rank = None if name_problem else AdapterConfig.model_construct(name=entry.name, source=entry.path).rank()
                if name_problem:
                    self._skip(entry.path, f"its name cannot be an adapter's: {name_problem}")
                elif entry.name in others:
                    self._skip(entry.path, f"{entry.name!r} is another model's, alias's or adapter's name")
                elif rank is not None and any(rank > e.max_lora_rank for e in model.engines()):
                    self._skip(entry.path, f"its rank {rank} is above engine.max_lora_rank")
                elif len(found) + len(model.adapters) < MAX_ADAPTERS_PER_MODEL:
                    found[entry.name] = entry.path
                else:
                    self._skip(entry.path, f"the model serves {MAX_ADAPTERS_PER_MODEL} adapters, the most one may")
        return found

    def _skip(self, path: str, why: str, where: str = "adapter_dirs") -> None:
        if path not in self._skipped:
            self._skipped.add(path)
            log.warning("%s: %s is not served: %s", where, path, why)

    def find(self, name: str) -> Adapter | None:
        """The adapter `name` names: its own name, or `<model>:<adapter>`."""
        adapter = self._by_name.get(name)
        if adapter is not None:
            return adapter
        base_name, colon, adapter_name = name.rpartition(":")
        if not colon:
            return None
        base = self.config.find_model(base_name)
        return self._by_model.get(base.name, {}).get(adapter_name) if base is not None else None

    def of(self, model: ModelConfig) -> list[Adapter]:
        return sorted(self._by_model.get(model.name, {}).values(), key=lambda a: a.name)

    def check_addition(self, model: ModelConfig, name: str) -> None:
        """Whether `name` may become (or replace the files of) an adapter of `model`: 400 for a name no route
        could carry, 409 for one taken."""
        problem = adapter_name_problem(name)
        if problem is not None:
            raise ApiError(400, problem, param="name", code="invalid_adapter_name")
        if not model.lora:
            raise ApiError(409, f"model {model.name!r} does not run LoRA: set `engine.enable_lora: true` (or list "
                           "`adapters`) in its config to serve adapters", param="model", code="lora_not_enabled")
        if self.config.find_model(name) is not None:
            raise ApiError(409, f"{name!r} is the name of a model or alias; model, alias and adapter names must "
                           "be unique", param="name", code="adapter_name_taken")
        other = self._by_name.get(name)
        if other is not None and other.base.name != model.name:
            raise ApiError(409, f"{name!r} is an adapter of model {other.base.name!r}; adapter names must be "
                           "unique", param="name", code="adapter_name_taken")
        if other is None and len(self._by_model.get(model.name, {})) >= MAX_ADAPTERS_PER_MODEL:
            raise ApiError(409, f"model {model.name!r} serves {MAX_ADAPTERS_PER_MODEL} adapters, the most one "
                           "model may; remove one first", param="model", code="too_many_adapters")
