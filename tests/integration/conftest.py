"""Integration apps share one kept Ray cluster (tests/integration/local_app.py, `keep_cluster`), as the
e2e apps do. Modules marked `own_cluster` start a cluster of their own (a simulated multi-node one, a
bare `ray.init`, a gateway on a public address): they sort last in the tier and stop the kept one first,
since two clusters would not both find free cores on a 2-core machine."""

from __future__ import annotations

import pytest

from tests.integration.local_app import stop_kept_cluster


@pytest.fixture(scope="module", autouse=True)
def _own_cluster_stops_the_kept_one(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("own_cluster"):
        stop_kept_cluster()
