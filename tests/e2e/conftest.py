"""The real thing: Ray Serve + vLLM CPU engines + builtin models, driven over HTTP.

One Ray cluster serves the e2e apps one after another (tests/integration/local_app.py, `keep_cluster`):
first the shipped configs/local.yaml (`live_app`, shared by every test that needs no app of its own;
an app with two engines takes about a minute to come up on 2 cores), then each `own_app` module's
app, swapped in with `serve.run` after the previous one is deleted. Tests marked `own_cluster` start
a Ray cluster of their own (a simulated multi-node one, `ray start` in a shell, a fresh metrics
agent); they run last, after the kept cluster has been stopped, because two clusters' engines would
not both find free cores on a 2-core machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from tests.integration.local_app import local_app, stop_kept_cluster

from . import keyed_app, routing_app
from .live import APP_NAME, LiveApp, local_app_args, wait_ready

# The keyed app's keys reach its gateway as a real deployment gives them: in the environment of the
# processes Ray starts. Ray's processes inherit the environment of the cluster's start, so they are
# set before the first app starts the kept cluster (they are random, and no other app reads them).
os.environ.update(keyed_app.ENV)
# The same way, the routing app's nodes find its object store (an S3 endpoint in this process).
os.environ.update(routing_app.object_store_env())

_live = ExitStack()  # the shared app while it runs
_keyed = ExitStack()  # the keyed app (tests/e2e/keyed_app.py) while it runs
_routing = ExitStack()  # the two-replica routing app (tests/e2e/routing_app.py) while it runs
_live_app: list[LiveApp] = []


def _stop_live_app() -> None:
    _live_app.clear()
    _live.close()


@pytest.fixture(scope="session")
def live_app() -> Iterator[LiveApp]:
    """configs/local.yaml served on the kept Ray cluster in this process."""
    if not _live_app:
        base = _live.enter_context(local_app(local_app_args(), APP_NAME, keep_cluster=True))
        wait_ready(base)
        _live_app.append(LiveApp(base_url=base))
    yield _live_app[0]
    _stop_live_app()


@pytest.fixture(autouse=True)
def _shared_app_still_up(request: pytest.FixtureRequest) -> None:
    """A test of the shared app after another app replaced it would only see Serve's 404s: say why instead."""
    if "live_app" in request.fixturenames and (request.getfixturevalue("live_app") and not _live_app):
        pytest.fail("the shared app was stopped before this test: a test sorted before it swapped in its own app")


@pytest.fixture(scope="session")
def exclusive_machine() -> None:
    """For tests that start their own cluster: no app, and no kept cluster, may hold the cores."""
    _stop_live_app()
    _keyed.close()
    _routing.close()
    stop_kept_cluster()


@pytest.fixture(scope="session")
def keyed_app_url(tmp_path_factory) -> Iterator[str]:
    """The app with keys, quotas and limits (tests/e2e/keyed_app.py), shared by the modules that use it.
    They sort next to each other (by file name); the hook below stops it after the last."""
    _stop_live_app()
    yield _keyed.enter_context(keyed_app.keyed_app(tmp_path_factory.mktemp("secrets")))
    _keyed.close()


@pytest.fixture(scope="session")
def routing_live_app(tmp_path_factory) -> Iterator[LiveApp]:
    """The two-replica app with LoRA adapters (tests/e2e/routing_app.py), shared like the keyed app."""
    _stop_live_app()
    yield _routing.enter_context(routing_app.routing_app(tmp_path_factory.mktemp("routing")))
    _routing.close()


# The fixtures that swap an app of their own in for the shared one. A test using one must be marked
# `own_app`, so that it sorts after every test of the shared app: unmarked, it sorted among them
# (stop 53), stopped the shared app half way, and every later test of either app got Serve's 404.
_SWAPPING_FIXTURES = ("keyed_app_url", "routing_live_app")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = sorted({item.nodeid.split("::")[0] for item in items
                       if any(f in getattr(item, "fixturenames", ()) for f in _SWAPPING_FIXTURES)
                       and not item.get_closest_marker("own_app")})
    if unmarked:
        raise pytest.UsageError(f"these use an app of their own and must be marked own_app: {unmarked}")


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for fixture, stack in zip(_SWAPPING_FIXTURES, (_keyed, _routing), strict=True):
        if fixture in getattr(item, "fixturenames", ()) and (
                nextitem is None or fixture not in getattr(nextitem, "fixturenames", ())):
            stack.close()  # the next test deploys an app of its own
