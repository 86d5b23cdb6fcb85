"""A local Ray cluster serving one Shunter app in this process, through fault_engine.py's factory.

Which engine a model gets depends on its source: `fake:*` sources get the FAKE engine (fault tests),
any other source the real vLLM engine (e2e tests of keys, tiers, observability and rollouts).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.e2e.live import free_port

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "tests.integration.fault_engine:FaultInjectingEngine.start"


@contextmanager
def local_app(args: dict[str, Any], name: str, env: dict[str, str] | None = None,
              metrics_port: int | None = None, blocking: bool = True, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve the Shunter config `args` as app `name` on a free port; yields its base URL.

    `blocking=False` returns before the app is RUNNING (for apps with a model that never starts)."""
    import ray
    from ray import serve

    from deployments.app import assemble
    from shunter.config import parse_config

    extra = {"_metrics_export_port": metrics_port} if metrics_port else {}
    # Replica processes import the fake engine from the repository's tests package.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), **(env or {})}}, **extra)
    try:
        port = free_port()
        serve.start(http_options={"host": host, "port": port})
        app = assemble(parse_config(args), engine_factory=FACTORY)
        if blocking:
            serve.run(app, name=name, route_prefix="/")
        else:
            serve._run(app, _blocking=False, name=name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
