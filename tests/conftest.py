"""Marks each test by its folder (unit / integration / e2e) so `-m` selections work, and orders tiers.

Order: unit, integration, e2e, then tests that start a Ray cluster of their own. Integration and e2e
tests each bring up a Ray cluster in this process; running tier by tier lets each tier stop its
cluster before the next one starts, so their engines never compete for the same cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_TIERS = ("unit", "integration", "e2e")


def _tier(item: pytest.Item) -> int:
    parts = Path(str(item.fspath)).parts
    return next((i for i, tier in enumerate(_TIERS) if tier in parts), len(_TIERS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item)
        if tier < len(_TIERS):
            item.add_marker(getattr(pytest.mark, _TIERS[tier]))
    items.sort(key=lambda item: (_tier(item), item.get_closest_marker("own_cluster") is not None))
