"""Every metric a module records is one it builds: each module builds its metrics lazily from a `_NAMES`
tuple (shunter.metric_catalog), and a name recorded but not built is a KeyError at run time, inside
bookkeeping that must never fail a request (found once: a routing metric added to the catalog and used,
but not built, stopped a rollout's samples)."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

MODULES = ["shunter.deployments.gateway.telemetry", "shunter.deployments.gateway.access", "shunter.deployments.gateway.tiering",
           "shunter.deployments.gateway.usage",
           "shunter.deployments.replica.telemetry", "shunter.routing.metrics", "shunter.deployments.batch.metrics"]


@pytest.mark.parametrize("name", MODULES)
def test_a_module_records_only_the_metrics_it_builds(name):
    module = importlib.import_module(name)
    used = set(re.findall(r"""\[["'](shunter_[a-z0-9_]+)["']\]""", inspect.getsource(module)))
    assert used, f"{name} records no metric by name: the pattern is stale"
    assert used <= set(module._NAMES), sorted(used - set(module._NAMES))
