"""The gateway's live picture of each model's versions: traffic weights, which versions run, whether a
rollout is under way, and the request outcomes that rollout's gates judge.

The picture is refreshed from the cluster's control state (`shunter.ops.control`, Ray's key-value store) once
a second, off the request path; a request only reads it. The same read hands the replicas an operator
drains to the routers (`shunter.deployments.gateway.replica_admin`), and, for a model with standby replicas,
which of its replicas serve (`shunter.ops.standby`). Until the first read, and whenever the store
holds nothing newer for a model's current config, the config file's weights stand.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from shunter.config import ModelConfig, ShunterConfig
from shunter.deployments.gateway.lora import rollout_key
from shunter.ops import standby
from shunter.ops.control import ModelView, control, model_view, read_state
from shunter.ops.metrics import traffic_weight
from shunter.replica_protocol import AdapterRoute

log = logging.getLogger("ray.serve")

REFRESH_S = 1.0


class LiveVersions:
    def __init__(self, app: str, config: ShunterConfig, deployments: dict[str, dict[str, str]],
                 on_refresh: Callable[[dict[str, Any]], None] | None = None):
        """`deployments`: model -> version -> Ray deployment name. `on_refresh` gets every state read."""
        self.app = app
        self.on_refresh = on_refresh
        self.config = config
        self.deployments = deployments
        self.state: dict[str, Any] = {}
        self._samples: dict[str, list[tuple[str, float, bool, float | None, float | None]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._actor: Any = None
        self._exported: dict[str, dict[str, float]] = {}  # model -> the weights last exported
        # deployment -> which replicas serve and which stand by, as the autoscaling policy named them
        # (shunter.ops.standby); read only when a model keeps standby replicas.
        self.serving_sets: dict[str, dict[str, frozenset[str]]] = {}
        self._has_standby = any(m.standby_replicas for m in config.models)
        # id(model) -> (model, its fingerprint): a hash of its versions' config, asked on every request
        # (three times), and the config does not change under a running gateway. The model is kept so
        # that its id is never another's.
        self._fingerprints: dict[int, tuple[ModelConfig, str]] = {}

    # ---- reading (request path: no I/O) ------------------------------------------------------------

    def view(self, model: ModelConfig) -> ModelView:
        return model_view(self.state, model.name, self.fingerprint(model), model.file_weights())

    def fingerprint(self, model: ModelConfig) -> str:
        """`model.fingerprint`, computed once per model (a burst's profile: 4.5% of the gateway's CPU)."""
        kept = self._fingerprints.get(id(model))
        if kept is None or kept[0] is not model:
            kept = self._fingerprints[id(model)] = (model, model.fingerprint)
        return kept[1]

    def serving(self, model: ModelConfig) -> list[str]:
        """Versions that take traffic now, in weight order (the incoming version of a rollout first)."""
        return [v for v, w in self.view(model).weights if w > 0]

    def rollout_active(self, model: ModelConfig) -> bool:
        entry = (self.state.get("rollouts") or {}).get(model.name)
        return bool(entry) and entry["rollout"]["phase"] != "done" and \
            entry["context"].get("fingerprint") == self.fingerprint(model)

    def record(self, model: ModelConfig, version: str, ok: bool, ttft_s: float | None, e2e_s: float | None) -> None:
        """A request's outcome on `version`, kept for the gates while the model has a rollout."""
        if model.versioned and self.rollout_active(model):
            self._samples.setdefault(model.name, []).append((version, time.time(), ok, ttft_s, e2e_s))

    def record_request(self, model: ModelConfig, adapter: AdapterRoute | None, version: str, ok: bool,
                       ttft_s: float | None, e2e_s: float | None) -> None:
        """A request's outcome, for the gates of a rollout of its model's versions or of its adapter's."""
        self.record(model, version, ok, ttft_s, e2e_s)
        if adapter is not None and adapter.version is not None:
            self.record_key(rollout_key(model.name, adapter.name), adapter.version, ok, ttft_s, e2e_s)

    def record_key(self, key: str, version: str, ok: bool, ttft_s: float | None, e2e_s: float | None) -> None:
        """The same for the rollout under `key` (a LoRA adapter's: `<model>@<adapter>`), while it runs."""
        entry = (self.state.get("rollouts") or {}).get(key)
        if entry and entry["rollout"]["phase"] != "done":
            self._samples.setdefault(key, []).append((version, time.time(), ok, ttft_s, e2e_s))

    # ---- the control actor ---------------------------------------------------------------------------

    def context(self, model: ModelConfig) -> dict[str, Any]:
        """What the control actor needs to know of a model (it holds no config of its own)."""
        scaling = model.autoscaling
        return {
            "model": model.name,
            "fingerprint": model.fingerprint,
            "versions": model.version_names(),
            "file_weights": model.file_weights(),
            "deployments": self.deployments[model.name],
            "ready_replicas": max(1, scaling.min_replicas) if scaling else model.replicas,
            "rollout": model.rollout.model_dump(mode="json"),
        }

    def actor(self) -> Any:
        if self._actor is None:
            self._actor = control(self.app)
        return self._actor

    async def refresh_now(self) -> None:
        try:
            self.state = await asyncio.to_thread(read_state, self.app)
            if self._has_standby:
                self.serving_sets = await asyncio.to_thread(standby.read, self.app)
        except Exception:  # noqa: BLE001 - the GCS briefly unreachable: serve with the last picture
            log.warning("could not read the control state of app %s; keeping the last one", self.app,
                        exc_info=True)
            return
        if self.on_refresh is not None:
            self.on_refresh(self.state)

    # ---- background refresh --------------------------------------------------------------------------

    def ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await self.refresh_now()
            self._export_weights()
            self._flush()
            await asyncio.sleep(REFRESH_S)

    def _export_weights(self) -> None:
        """`shunter_traffic_weight`: the weights this gateway applies (the file's, a rollout's or an
        operator's), exported when they change."""
        for model in self.config.models:
            weights = dict(self.view(model).weights)
            if self._exported.get(model.name) != weights:
                self._exported[model.name] = weights
                for version in model.version_names():
                    traffic_weight(model.name, version, weights.get(version, 0.0))

    def _flush(self) -> None:
        samples, self._samples = self._samples, {}
        for model, batch in samples.items():
            try:
                self.actor().report.remote(model, batch)  # fire and forget: the gates tolerate a lost batch
            except Exception:  # noqa: BLE001
                log.warning("could not report %d request outcomes of model %s to the rollout controller",
                            len(batch), model, exc_info=True)
