"""A local Ray cluster serving one Shunter app in this process, through fault_engine.py's factory.

Which engine a model gets depends on its source: `fake:*` sources get the FAKE engine (fault tests),
any other source the real vLLM engine (e2e tests of keys, tiers, observability and rollouts).

`keep_cluster=True` (the integration and e2e apps) keeps the Ray cluster and Serve running after the
app: the next app with the same cluster settings is deployed on it (`serve.run`) instead of a fresh
cluster, and only the app is deleted (`serve.delete`: its replicas drain and stop, so their cores are
free for the next one). Starting and stopping Ray is ~10 s a module on 2 cores; the engines are the
same either way. Any other call, or `stop_kept_cluster()`, stops a kept cluster first. What an app's
processes need from the environment (API keys, the fault engines' control directory) is set in this
process's environment before the first app starts: Ray's processes inherit it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shunter.local_serve import HAPROXY_FOLDER, free_port, local_cluster_env, reap_haproxy
from shunter.ray_compat import init_metrics_port

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "tests.integration.fault_engine:FaultInjectingEngine.start"

_kept: dict[str, Any] = {}  # the kept cluster: its settings, HTTP port and generation
_generations = itertools.count(1)


def stop_kept_cluster() -> None:
    import ray
    from ray import serve

    if _kept:
        _kept.clear()
        serve.shutdown()
        ray.shutdown()
        reap_haproxy(os.environ.get(HAPROXY_FOLDER))  # a reload's HAProxy outlives the proxy actor


def _start(metrics_port: int | None, host: str) -> int:
    """Start Ray and Serve in this process; returns Serve's HTTP port."""
    import ray
    from ray import serve

    extra = init_metrics_port(metrics_port)
    os.environ.update(local_cluster_env())  # direct ingress, as `shunter serve` starts its cluster
    # Serve's controller loop and metrics export at Ray's own pace (0.1 s each), not Shunter's quieter
    # production one (shunter.cluster_quiet: 0.5 s and 1 s, for the idle tax a serving node pays): the
    # suite waits on hundreds of Serve state changes (deploys, replacements, rollout steps, scale
    # decisions) and measures no idle tax. Set here, for the clusters the tests start, and not for the
    # whole session: renderings the unit tests compare must see Shunter's own values.
    os.environ.update({"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "100"})
    # Replica processes import the fake engine from the repository's tests package.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}}, **extra)
    try:
        port = free_port()
        serve.start(http_options={"host": host, "port": port})
        return port
    except BaseException:
        ray.shutdown()
        raise


def _without_services_it_does_not_test(args: dict[str, Any]) -> dict[str, Any]:
    """An app whose every model is the FAKE engine (the fault tests: routing, breakers, failover, draining,
    admission) runs without the usage ledger unless its config says otherwise: the ledger is one more
    replica to start and stop on every deploy (about 5 s on 2 cores), and the apps with real engines (the
    keyed app's usage tests) test it. No app runs the Files API's BatchService unless its config has a
    `batch:` section (the keyed app's files tests), for the same reason."""
    sources = [m.get("source", "") for m in args.get("models", [])] + \
        [v.get("source", "") for m in args.get("models", []) for v in m.get("versions", [])]
    if "batch" not in args:  # the same for the Files API's service: the modules that test it say so
        args = {**args, "batch": {"enabled": False}}
    if "usage" in args or not sources or not all(str(s).startswith("fake:") for s in sources if s):
        return args
    return {**args, "usage": {"enabled": False}}


def redeploy(args: dict[str, Any], name: str) -> None:
    """Deploy `args` as app `name` on the running cluster, as `serve deploy` of a changed config does: only
    the deployments whose arguments changed are replaced. Returns once the app is RUNNING."""
    from ray import serve

    from shunter.config import parse_config
    from shunter.deployments.app import assemble

    serve.run(assemble(parse_config(_without_services_it_does_not_test(args)), engine_factory=FACTORY), name=name,
              route_prefix="/")


@contextmanager
def local_app(args: dict[str, Any], name: str, metrics_port: int | None = None, blocking: bool = True,
              host: str = "127.0.0.1", keep_cluster: bool = False) -> Iterator[str]:
    """Serve the Shunter config `args` as app `name` on a free port; yields its base URL.

    `blocking=False` returns before the app is RUNNING (for apps with a model that never starts).
    `keep_cluster`: see the module docstring (the kept cluster exports metrics: `kept_metrics_url()`)."""
    import ray
    from ray import serve

    from shunter.config import parse_config
    from shunter.deployments.app import assemble

    settings = (metrics_port, host)
    if keep_cluster and _kept.get("settings") == settings and ray.is_initialized():
        for other in list(serve.status().applications):  # one app at a time: they would share the cores
            serve.delete(other)
    else:
        stop_kept_cluster()
        port = _start(metrics_port or (free_port() if keep_cluster else None), host)
        if keep_cluster:
            _kept.update(settings=settings, port=port, generation=next(_generations))
        else:
            _kept.clear()
    port = _kept["port"] if keep_cluster else port
    generation = _kept.get("generation")
    stopped_cleanly = False
    try:
        if blocking:
            redeploy(args, name)
        else:
            app = assemble(parse_config(_without_services_it_does_not_test(args)), engine_factory=FACTORY)
            serve._run(app, _blocking=False, name=name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
        stopped_cleanly = True
    finally:
        if keep_cluster and _kept.get("generation") == generation:
            try:
                if not stopped_cleanly:  # a failed start: the next module gets a fresh cluster
                    raise RuntimeError(f"app {name} did not stop cleanly")
                serve.delete(name)  # its replicas drain and stop (Serve waits up to 60 s); the cluster stays
            except BaseException:
                stop_kept_cluster()
                if stopped_cleanly:
                    raise
        elif not keep_cluster:
            serve.shutdown()
            ray.shutdown()
            reap_haproxy(os.environ.get(HAPROXY_FOLDER))


def fault_dir() -> Path:
    """The fault engines' control directory (fault_engine.py), one per test session (tests/conftest.py).
    Its files are named by replica id, unique across apps, so every app on the kept cluster shares it."""
    import os

    return Path(os.environ["SHUNTER_FAULT_DIR"])


def kept_metrics_url() -> str:
    """The Prometheus endpoint of the running cluster's metrics agent."""
    import ray

    return f"http://127.0.0.1:{ray._private.worker._global_node.metrics_export_port}/metrics"
