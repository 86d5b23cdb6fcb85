"""The real thing: Ray Serve + vLLM CPU engines + builtin models, driven over HTTP.

One app (the shipped configs/local.yaml, on a free port) is shared by every e2e test of the session:
an app with two engines takes about a minute to come up on 2 cores. Tests marked `own_cluster` start
a Ray cluster of their own; they run last, after the shared app has been stopped, because two apps'
engines would not both find free cores on a 2-core machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from .live import APP_NAME, LiveApp, free_port, local_app_args, wait_ready

_shared: dict[str, LiveApp] = {}
_keyed = ExitStack()  # the keyed app (tests/e2e/keyed_app.py) while it runs


def _stop_shared_app() -> None:
    if not _shared:
        return
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    _shared.clear()


@pytest.fixture(scope="session")
def live_app() -> Iterator[LiveApp]:
    """configs/local.yaml served by a real local Ray cluster in this process."""
    import ray
    from ray import serve

    from deployments.app import build_app

    if APP_NAME not in _shared:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(local_app_args()), name=APP_NAME, route_prefix="/")
            app = LiveApp(base_url=f"http://127.0.0.1:{port}")
            wait_ready(app.base_url)
        except BaseException:  # a failed start must not leave Ray holding the cores for later modules
            serve.shutdown()
            ray.shutdown()
            raise
        _shared[APP_NAME] = app
    yield _shared[APP_NAME]
    _stop_shared_app()


@pytest.fixture(scope="session")
def exclusive_machine() -> None:
    """For tests that start their own cluster: the shared app must not hold the cores."""
    _stop_shared_app()



@pytest.fixture(scope="session")
def keyed_app(exclusive_machine, tmp_path_factory) -> Iterator[str]:
    """The app with keys, quotas and limits (tests/e2e/keyed_app.py), shared by the modules that use it.
    They sort next to each other (own_cluster, by file name); the hook below stops it after the last."""
    from .keyed_app import keyed_app as start

    yield _keyed.enter_context(start(tmp_path_factory.mktemp("secrets")))
    _keyed.close()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if "keyed_app" in getattr(item, "fixturenames", ()) and (
            nextitem is None or "keyed_app" not in getattr(nextitem, "fixturenames", ())):
        _keyed.close()  # the next test may start a cluster of its own
