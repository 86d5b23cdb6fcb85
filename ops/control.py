"""The cluster-side state of a Shunter application: traffic weights per model and rollout states.

It lives in the cluster, not in any CLI process: a detached, named Ray actor per application, which
saves every change to Ray's internal key-value store (kept by the GCS, which KubeRay can make fault
tolerant). The actor restarts on failure and reloads what it saved, so a CLI killed mid-rollout, or
the actor itself dying, loses nothing: the next call finds the state where it was.

Readers (the gateway) poll `weights(since)` with the stamp they hold; the stamp rises on every change,
so an unchanged state costs one small call and no copy.
"""

from __future__ import annotations

import json
from typing import Any

import ray

NAMESPACE = "shunter"
_KV_NAMESPACE = b"shunter"


def actor_name(app: str) -> str:
    return f"shunter-control-{app}"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class ShunterControl:
    def __init__(self, app: str):
        self.app = app
        self._key = f"control/{app}".encode()
        self.state: dict[str, Any] = {"stamp": 0, "weights": {}, "rollouts": {}}
        saved = _kv_get(self._key)
        if saved:
            self.state = json.loads(saved)

    def weights(self, since: int = -1) -> tuple[int, dict[str, list[tuple[str, float]]] | None]:
        """(stamp, every model's ordered (version, weight) list), or (stamp, None) when unchanged."""
        if since == self.state["stamp"]:
            return since, None
        return self.state["stamp"], {m: [tuple(w) for w in ws] for m, ws in self.state["weights"].items()}

    def set_weights(self, model: str, weights: list[tuple[str, float]]) -> int:
        """Replace one model's weights (an ordered list: the version listed first takes the low end of the
        session hash range; see routing.versions)."""
        if not weights or any(w < 0 for _, w in weights) or sum(w for _, w in weights) <= 0:
            raise ValueError(f"weights for {model!r} need a version with weight > 0 and none below 0: {weights}")
        self.state["weights"][model] = [[v, float(w)] for v, w in weights]
        return self._save()

    def rollout(self, model: str) -> dict[str, Any] | None:
        return self.state["rollouts"].get(model)

    def save_rollout(self, model: str, rollout: dict[str, Any] | None) -> int:
        if rollout is None:
            self.state["rollouts"].pop(model, None)
        else:
            self.state["rollouts"][model] = rollout
        return self._save()

    def _save(self) -> int:
        self.state["stamp"] += 1
        _kv_put(self._key, json.dumps(self.state).encode())
        return self.state["stamp"]


def control(app: str) -> Any:
    """The application's control actor, started if it is not running (call inside a Ray job)."""
    return ShunterControl.options(name=actor_name(app), namespace=NAMESPACE, lifetime="detached",
                                  get_if_exists=True).remote(app)


def _kv_put(key: bytes, value: bytes) -> None:
    # Ray's GCS key-value store has no public API; the Serve controller keeps its own checkpoints there.
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=_KV_NAMESPACE)


def _kv_get(key: bytes) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key, namespace=_KV_NAMESPACE)
