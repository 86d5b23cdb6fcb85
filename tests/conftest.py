"""Marks each test by its folder (unit / integration / e2e) so `-m` selections work, and orders tiers.

Tests marked `gpu` (optionally `gpu(devices=N)`) are skipped, with the reason, where torch sees fewer
CUDA devices. Order: unit, integration, e2e; within a tier, tests on the shared app first, then
`own_app` tests (an app of their own on the kept cluster), then `own_cluster` tests (a Ray cluster of
their own). Integration and e2e
tests each bring up a Ray cluster in this process; running tier by tier lets each tier stop its
cluster before the next one starts, so their engines never compete for the same cores.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

pytest_plugins = ["tests.budget"]  # per-test hang guards; the time table (reported, never asserted)

_TIERS = ("unit", "integration", "e2e")

# Machine-global state made per session: the CPU-core locks engines take (platform/shunter/cpu_cores.py)
# live in a dir of this session's own, which every Ray process it starts inherits, so another session
# on the machine (or a crashed one's leftovers) never holds cores this one's engines wait for.
os.environ.setdefault("SHUNTER_CORE_LOCK_DIR", tempfile.mkdtemp(prefix="shunter-test-cores-"))
# Likewise the fault engines' control directory (tests/integration/fault_engine.py), shared by the apps
# of the kept cluster (tests/integration/local_app.py).
os.environ.setdefault("SHUNTER_FAULT_DIR", tempfile.mkdtemp(prefix="shunter-test-faults-"))

# Ray's processes export their metrics every 10 s by default; the tests that read metrics (scrapes,
# Prometheus) would wait up to that long for each count. Every cluster the suite starts exports every 2 s.
os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")

def _tier(item: pytest.Item) -> int:
    parts = Path(str(item.fspath)).parts
    return next((i for i, tier in enumerate(_TIERS) if tier in parts), len(_TIERS))


def _cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch, or a CPU build: no GPU
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    devices = _cuda_devices() if gpu_tests else 0
    for item in gpu_tests:
        needed = item.get_closest_marker("gpu").kwargs.get("devices", 1)
        if devices < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s); this machine has {devices}"))
    for item in items:
        tier = _tier(item)
        if tier < len(_TIERS):
            item.add_marker(getattr(pytest.mark, _TIERS[tier]))
    items.sort(key=lambda item: (_tier(item), 2 if item.get_closest_marker("own_cluster") else
                                 1 if item.get_closest_marker("own_app") else 0))


_EXIT_STATUS: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # After every other plugin's: the status a plugin may have set on the session (session.exitstatus), which
    # the `exitstatus` argument (given before any hook ran) never shows.
    _EXIT_STATUS.append(int(session.exitstatus))
    # A run that ends on the kept cluster (no own-cluster module after it: `pytest tests/e2e/test_x.py`)
    # stops it here, with the HAProxy its proxy started: the interpreter's exit, where Ray would stop the
    # cluster, is skipped (pytest_unconfigure). Each such run left one HAProxy behind.
    kept = sys.modules.get("tests.integration.local_app")
    if kept is not None:
        try:
            kept.stop_kept_cluster()
        except Exception as exc:  # noqa: BLE001 - the run's outcome is the tests', not this cleanup's
            print(f"\nthe kept Ray cluster did not stop cleanly: {exc!r}", file=sys.stderr)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave with the session's status once pytest has reported everything, skipping the interpreter's
    teardown: a full run on 2026-11-26 passed every test and then died of a segmentation fault while
    the native libraries of Ray, vLLM and ZeroMQ were finalised, turning a green run red."""
    # A usage error is printed by pytest's main() after this hook: leaving here would swallow it.
    if _EXIT_STATUS and _EXIT_STATUS[-1] != pytest.ExitCode.USAGE_ERROR:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
