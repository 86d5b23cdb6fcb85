"""Time budgets for the suite: every test has a timeout, and every module and tier a share of the
30 minutes `make test` may take on CI's 2-core machine.

A hang fails its test at its timeout (pytest-timeout, signal method: the test fails, its fixtures are
torn down, later modules still run). A module that outgrows its share fails the session, with a table of
where the time went, the day it happens, not the day CI runs out of time. Budgets count wall time of
setup, call and teardown, so a module's shared app start is charged to it.

Timings vary ~30% run to run on these machines; module shares leave that much room over what was
measured. A tier's share is what it measured on 2026-11-26 (2 cores: unit 34-41 s, integration 565 s,
e2e 1,066 s; CI's machine ran about 4% slower that day) plus what is left of the 30 minutes; together
the shares are the 30 minutes. A tier past its share is reported; the whole suite past the 30 minutes
fails the run (tiers trade time with each other run to run; the limit is on the whole): that is the day
to make room (share an app, drop a boot), not the day CI times out.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import pytest

# Per-test timeout (seconds) by tier, unless the test sets its own with @pytest.mark.timeout.
TEST_TIMEOUT_S = {"unit": 60, "integration": 420, "e2e": 600}

# The whole suite's wall time must stay under CI_LIMIT_S; each tier has a share of it.
CI_LIMIT_S = 30 * 60
TIER_BUDGET_S = {"unit": 50, "integration": 620, "e2e": 1130}

# Per module: the default share by tier, and modules that measurably need more (with why).
MODULE_BUDGET_S = {"unit": 40, "integration": 150, "e2e": 150}
MODULE_OVERRIDES_S = {
    "tests/integration/test_rollouts.py": 360,  # rollouts under load, one killed mid-way; CLI, weights, drains
    "tests/e2e/test_autoscaling.py": 300,  # a real engine scaled 1 -> 2 -> 1 and from zero
    "tests/e2e/test_parallel.py": 180,  # a TP=2 engine, then a PP=2 one (compiled)
    "tests/e2e/test_rollouts.py": 180,  # a real second version started and promoted under load
    "tests/e2e/test_routing_prefixes.py": 180,  # two LoRA engines start; one drained and replaced
    "tests/e2e/test_observability.py": 210,  # three versions (two real), a rollback, a drain, adapters
    "tests/e2e/test_tiers.py": 180,  # three engines; the top tier filled stream by stream
}

_TIERS = ("unit", "integration", "e2e")


def tier_of(path: str) -> str | None:
    parts = Path(path).parts
    return next((t for t in _TIERS if t in parts), None)


def module_budget(module: str) -> float | None:
    tier = tier_of(module)
    if tier is None:
        return None
    return MODULE_OVERRIDES_S.get(module, MODULE_BUDGET_S[tier])


class Budget:
    def __init__(self) -> None:
        self.modules: dict[str, float] = defaultdict(float)
        self.started = time.monotonic()
        self.whole_tiers: set[str] = set()  # tiers the session runs every test of (budgets apply to those)

    # ---- hooks --------------------------------------------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        for item in items:
            tier = tier_of(str(item.fspath))
            if tier and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S[tier]))
        # A budget says something only about a whole module or tier: not when -k or a node id picked a part.
        if not config.getoption("keyword") and not config.getoption("markexpr") and \
                all("::" not in str(arg) for arg in config.args):
            self.whole_tiers = {tier_of(str(i.fspath)) for i in items} - {None}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.modules[report.nodeid.split("::")[0]] += report.duration

    def pytest_terminal_summary(self, terminalreporter, exitstatus: int, config: pytest.Config) -> None:
        over = self.overruns()
        write = terminalreporter.write_line
        terminalreporter.section("time per module (setup + call + teardown)")
        tiers: dict[str, float] = defaultdict(float)
        small = 0
        for module, spent in sorted(self.modules.items(), key=lambda kv: -kv[1]):
            tiers[tier_of(module) or "other"] += spent
            budget = module_budget(module)
            if spent < 5:
                small += 1
                continue
            write(f"{spent:8.1f}s  {module}" + (f"  (budget {budget:g}s)" if budget else ""))
        if small:
            write(f"{small} more module(s) under 5s each")
        write("  ".join(f"{tier}: {spent:.0f}s" for tier, spent in tiers.items())
              + f"  wall: {time.monotonic() - self.started:.0f}s")
        if over:
            terminalreporter.section("TIME BUDGET EXCEEDED", red=True)
            for line in over:
                write(line, red=True)
        tiers_over = self.tier_overruns()
        if tiers_over:
            terminalreporter.section("TIER OVER ITS SHARE", yellow=True)
            for line in tiers_over:
                write(line, yellow=True)
        whole = self.suite_overrun()
        if whole:
            terminalreporter.section("SUITE OVER THE LIMIT", red=True)
            write(whole, red=True)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        failed = self.overruns() or self.suite_overrun()
        if failed and session.exitstatus == 0:
            session.exitstatus = 1

    # ---- the verdict --------------------------------------------------------------------------------

    def overruns(self) -> list[str]:
        """Modules over their share, among the tiers this session runs whole."""
        lines = []
        for module, spent in self.modules.items():
            budget = module_budget(module)
            if tier_of(module) in self.whole_tiers and budget is not None and spent > budget:
                lines.append(f"{module}: {spent:.0f}s, over its {budget:g}s share (tests/budget.py)")
        return lines

    def suite_overrun(self) -> str | None:
        """The whole suite (every tier run whole) past CI_LIMIT_S."""
        if set(self.whole_tiers) != set(_TIERS):
            return None
        spent = time.monotonic() - self.started
        return f"the suite took {spent:.0f}s, past the {CI_LIMIT_S // 60}-minute limit (tests/budget.py)" \
            if spent > CI_LIMIT_S else None

    def tier_overruns(self) -> list[str]:
        tiers: dict[str, float] = defaultdict(float)
        for module, spent in self.modules.items():
            if tier_of(module) in self.whole_tiers:
                tiers[tier_of(module)] += spent  # type: ignore[index]
        return [f"the {tier} tier: {spent:.0f}s, over its {TIER_BUDGET_S[tier]}s share of the "
                f"{CI_LIMIT_S // 60}-minute limit (tests/budget.py)"
                for tier, spent in tiers.items() if spent > TIER_BUDGET_S[tier]]


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(Budget(), "shunter-budget")
