"""Every private Ray API Shunter uses, each behind one named entry here and nowhere else.

Shunter builds on Ray Serve's public surface; where none serves, the private call is made in this module
only, and each entry says which Ray it was checked against, why no public API serves, and what breaks
without it. `tests/unit/test_compat.py` fails, naming the entry, when the pinned Ray changes the shape
an entry relies on: upgrading Ray means running it first and fixing what it names here.

Imports of Ray happen inside the entries (the one class Ray's router is, is built on first use), so
importing this module stays cheap. docs/design.md ("Private Ray and vLLM APIs") lists the entries.
"""

from __future__ import annotations

import importlib
from typing import Any

RAY_CHECKED = "2.60.0"
"""The Ray release every entry below was checked against (ray[serve] as pinned in pyproject.toml); not a
private use itself. tests/unit/test_compat.py fails while another release is installed."""

# ---- request routers (shunter.routing.routers) ---------------------------------------------------------

POWER_OF_TWO_ROUTER = "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter"
"""Import path of Ray Serve's default request router (two random replicas, the shorter queue).

Checked against ray 2.60.0. Why private: Ray Serve 2.60 exports only the `RequestRouter` base class and
its mixins (`ray.serve.request_router`), not its own default policy. What breaks without it: routing
policy `power_of_two` (Ray's policy behind Shunter's guard) would have to re-implement Ray's router; the
import path is also a sample custom router in the unit tests."""


def power_of_two_router() -> type:
    """Ray Serve's default request router class (`POWER_OF_TWO_ROUTER`), for subclassing.

    Checked against ray 2.60.0. Why private: it lives in `ray.serve._private.request_router.pow_2_router`;
    no public module re-exports it. What breaks without it: `shunter.routing.routers.PowerOfTwoRouter`
    (policy `power_of_two`) cannot be defined, and `shunter.routing.routers` does not import."""
    module, _, name = POWER_OF_TWO_ROUTER.partition(":")
    return getattr(importlib.import_module(module), name)


def router_deployment(router: Any) -> tuple[str, str]:
    """(application, deployment) names of the deployment a Ray `RequestRouter` routes for.

    Checked against ray 2.60.0: `RequestRouter.__init__` stores its `DeploymentID` as
    `self._deployment_id` (fields `app_name`, `name`). Why private: the public surface has the
    `app_name` property only, nothing names the deployment, and `initialize_state` is not given it.
    What breaks without it: a router could not find its deployment's shared routing state (prefix index,
    breakers, in-flight counts) nor default the model's name, so every policy's guard fails to start."""
    dep = router._deployment_id
    return dep.app_name, dep.name


def cached_queue_len(router: Any, replica_id: Any) -> int | None:
    """Requests Ray's queue-length cache holds for `replica_id` (its last report plus what this router
    sent since), or None when it has no fresh entry.

    Checked against ray 2.60.0: `RequestRouter.__init__` sets `self._replica_queue_len_cache`, a
    `ReplicaQueueLengthCache` whose `get(replica_id)` answers None for a missing or timed-out entry.
    Why private: the cache and its class are in `ray.serve._private` (2.60's `replica_queue_len_cache`
    property returns the same private object); no public API reports a replica's queue length to a
    router. What breaks without it: a router's load counts only its own process's requests, blind to
    the traffic other gateway replicas send to the same replica."""
    return router._replica_queue_len_cache.get(replica_id)


def request_note(pending: Any, name: str, default: Any = None) -> Any:
    """What a router noted on a Ray `PendingRequest` under `name` (`set_request_note`), or `default`.

    Checked against ray 2.60.0: `PendingRequest` is a plain (not frozen, not slotted) dataclass, and
    Ray's router passes one object to every `choose_replicas` call for a request (a retry after a
    rejection too) and then to `on_request_routed`. Why private: notes are attributes Ray does not
    declare (`_shunter_<name>`), and nothing public carries a router's own per-request state from
    choosing to routing. What breaks without it: the prefix key is recomputed per call, routing-decision
    reasons (`prefix_hit`/`load_fallback`) and `breaker_skip` counts are lost."""
    return getattr(pending, f"_shunter_{name}", default)


def set_request_note(pending: Any, name: str, value: Any) -> None:
    """Note `value` under `name` on a Ray `PendingRequest`, for a later `request_note`.

    Checked against ray 2.60.0; see `request_note` (why private, what breaks without it)."""
    setattr(pending, f"_shunter_{name}", value)


# ---- the GCS key-value store (shunter.ops.control.RayStore, used by shunter.ops.backlog too) ------------


def kv_get(key: bytes, namespace: bytes) -> bytes | None:
    """The value of `key` in Ray's GCS key-value store (None when unset). A blocking call.

    Checked against ray 2.60.0: `ray.experimental.internal_kv._internal_kv_get(key, *, namespace)`.
    Why private: Ray has no public key-value API; the Serve controller keeps its own checkpoints there
    the same way. What breaks without it: the control state (traffic weights, live versions, rollouts,
    cordons, adapters) and the gateways' backlog reports cannot be read by the gateways, routers and
    autoscaling policy."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key, namespace=namespace)


def kv_put(key: bytes, value: bytes, namespace: bytes) -> None:
    """Set `key` to `value` in Ray's GCS key-value store (overwriting). A blocking call.

    Checked against ray 2.60.0: `ray.experimental.internal_kv._internal_kv_put(key, value, overwrite,
    *, namespace)`. Why private: as `kv_get`. What breaks without it: the control actor cannot save
    state (rollouts, weights, cordons: lost when it restarts, never seen by the gateways), and the
    gateways cannot report their backlog to the autoscaling policy."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=namespace)


def kv_keys(prefix: bytes, namespace: bytes) -> list[bytes]:
    """The keys under `prefix` in Ray's GCS key-value store. A blocking call.

    Checked against ray 2.60.0: `ray.experimental.internal_kv._internal_kv_list(prefix, *, namespace)`.
    Why private: as `kv_get`. What breaks without it: the autoscaling policy cannot find the gateways'
    backlog reports (`shunter.ops.backlog.backlog`), so it scales on Ray's queues alone."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_list(prefix, namespace=namespace)


# ---- Serve's context inside a replica (shunter.deployments.gateway) ----------------------------------------


def serve_http_host() -> str | None:
    """The address Serve's HTTP proxies listen on (the Serve config's `http_options.host`). Raises when
    no Serve controller runs (outside a Serve cluster).

    Checked against ray 2.60.0: `ray.serve.context._get_global_client()` returns the
    `ServeControllerClient`, whose `http_config` is the cluster's `HTTPOptions`. Why private: Serve has
    no public getter for its HTTP options inside a replica. What breaks without it: the gateway cannot
    refuse to serve without API keys on a public bind (the check is skipped, with a warning)."""
    from ray.serve.context import _get_global_client

    return _get_global_client().http_config.host


def serve_request_id() -> str | None:
    """Serve's id of the request being handled (the client's `X-Request-ID`, or the one Serve's proxy made
    and returns as `x-request-id`); "" or None outside a Serve request.

    Checked against ray 2.60.0: `ray.serve.context._get_serve_request_context()` returns a
    `_RequestContext` whose `request_id` is "" outside a request. Why private: the request context is
    not exported by Serve 2.60, and the proxy's id reaches a replica only through it. What breaks
    without it: Serve's access log, Shunter's logs and spans and the client would each name a request
    differently (the gateway makes up an id of its own)."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id
    except Exception:  # noqa: BLE001 - outside a Serve request (unit tests)
        return None


# ---- starting a local cluster (shunter.local_serve) --------------------------------------------------------


def init_metrics_port(port: int | None) -> dict[str, Any]:
    """Keyword arguments for `ray.init` that make the cluster's metrics exporter listen on `port` ({} for
    None: Ray picks one).

    Checked against ray 2.60.0: `ray.init(**kwargs)` pops `_metrics_export_port`. Why private: `ray start`
    has `--metrics-export-port`, `ray.init` no public twin. What breaks without it: a Prometheus started
    before the cluster (bench, demo, the integration tests) cannot know which port to scrape."""
    return {"_metrics_export_port": port} if port else {}
