"""The suite's time is reported, never asserted (tests/budget.py): a module, tier or suite past its share is
a warning line and a field of results/suite-times.json, and the session's status is the tests' alone; a
test that hits its hang guard says in which phase and where it waited."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.budget import PACE, ROOT, TEST_TIMEOUT_S, Budget, hang_report, machine, machine_kind, module_budget

pytestmark = pytest.mark.unit

pytest_plugins = ["pytester"]

INTEL = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\n" \
        "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile\n"
EPYC = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"


def test_the_machine_is_named_with_the_flags_that_set_the_engines_speed():
    assert machine_kind(INTEL) == "avx512"
    assert machine_kind(EPYC) == "avx2"
    assert machine_kind("") == "avx2", "no flags: no AVX-512"
    intel = machine(INTEL)
    assert intel["cpu_model"] == "Intel(R) Xeon(R) Platinum 8488C"
    assert intel["isa_flags"] == ["avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile",
                                  "amx_bf16"]
    assert machine(EPYC)["isa_flags"] == ["avx", "avx2", "fma", "f16c"]


def test_shares_scale_with_the_pace_and_are_strict_on_avx512():
    assert PACE["avx512"] == 1.0
    assert module_budget("tests/e2e/test_autoscaling.py") == 300
    assert module_budget("tests/e2e/test_autoscaling.py", PACE["avx2"]) == round(300 * PACE["avx2"])
    assert module_budget("tests/unit/test_x.py", PACE["avx2"]) == round(40 * PACE["avx2"])
    assert module_budget("docs/x.py") is None


def test_over_share_is_listed_and_never_a_verdict():
    budget = Budget()
    budget.pace = 1.0
    budget.whole_tiers = {"unit", "integration", "e2e"}
    budget.modules.update({"tests/e2e/test_routing_adapters.py": 163, "tests/unit/test_a.py": 1})
    budget.started -= 2454  # the landed head's run of issue 51: 40:54
    table = budget.table()
    assert table["over_share"] == [
        "tests/e2e/test_routing_adapters.py: 163s, over its 150s share",
        "the suite: 2454s, over its goal of 1200s (20 minutes on AVX-512, x1 here)"]
    assert table["tiers_s"] == {"e2e": 163, "unit": 1}
    assert not hasattr(budget, "pytest_sessionfinish"), "the time table never sets the session's status"


def test_a_part_of_a_tier_is_measured_against_no_share():
    budget = Budget()
    budget.whole_tiers = set()  # -k, -m or a node id picked the tests
    budget.modules["tests/e2e/test_routing_adapters.py"] = 10_000
    assert budget.table()["over_share"] == []


def test_a_slow_run_passes_and_writes_its_table(pytester, monkeypatch, tmp_path):
    """An inner session whose only module is far past a share of 0 s: green, a warning, and the file."""
    import tests.budget as budget_module

    monkeypatch.setattr(budget_module, "MODULE_BUDGET_S", {"unit": 0, "integration": 0, "e2e": 0})
    monkeypatch.setattr(budget_module, "RESULTS", tmp_path / "suite-times.json")
    pytester.makepyfile(test_slow="import time\n\ndef test_slow():\n    time.sleep(0.05)\n")
    unit = pytester.path / "unit"
    unit.mkdir()
    (pytester.path / "test_slow.py").rename(unit / "test_slow.py")
    result = pytester.runpytest_inprocess("-p", "tests.budget", "-p", "no:cacheprovider", str(unit))
    result.assert_outcomes(passed=1)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*OVER ITS SHARE*", "*unit/test_slow.py: *s, over its 0s share*"])
    table = json.loads((tmp_path / "suite-times.json").read_text())
    assert table["outcomes"] == {"passed": 1}
    phases = table["module_phases_s"]["unit/test_slow.py"]
    assert set(phases) == {"setup", "call", "teardown"} and phases["call"] >= 0.05, phases
    assert sum(phases.values()) == pytest.approx(table["modules_s"]["unit/test_slow.py"], abs=0.2)
    assert table["whole_tiers"] == ["unit"]
    assert set(table["machine"]) >= {"cpu_model", "isa_flags", "kind", "cores"}


def test_every_test_gets_at_least_its_tiers_hang_guard(pytester, monkeypatch, tmp_path):
    import tests.budget as budget_module

    monkeypatch.setattr(budget_module, "RESULTS", tmp_path / "suite-times.json")
    unit = pytester.path / "unit"
    unit.mkdir()
    (unit / "test_guards.py").write_text(textwrap.dedent(f"""
        import pytest

        def test_default(request):
            assert request.node.get_closest_marker("timeout").args[0] == {TEST_TIMEOUT_S["unit"]}

        @pytest.mark.timeout(5)
        def test_a_tighter_one_is_raised(request):
            assert request.node.get_closest_marker("timeout").args[0] == {TEST_TIMEOUT_S["unit"]}

        @pytest.mark.timeout(10_000)
        def test_a_longer_one_is_kept(request):
            assert request.node.get_closest_marker("timeout").args[0] == 10_000
        """))
    result = pytester.runpytest_inprocess("-p", "tests.budget", "-p", "no:cacheprovider", str(unit))
    result.assert_outcomes(passed=3)


def test_a_hang_says_its_phase_and_what_it_waited_for():
    entries = [
        ("/x/site-packages/_pytest/python.py", 159, "pytest_pyfunc_call", "result = testfunction(**testargs)"),
        # Wherever the checkout is (CI clones it elsewhere): the project's own code is found under its root.
        (str(ROOT / "tests" / "e2e" / "live.py"), 70, "wait_ready", "time.sleep(0.25)"),
        ("/x/site-packages/pytest_timeout.py", 500, "handler", "timeout_sigalrm(item, settings)"),
    ]
    assert hang_report("setup", 900, entries) == (
        "hit its 900s hang guard in setup (tests/budget.py)\n"
        "waiting at live.py:70 in wait_ready: time.sleep(0.25)")
    deeper = entries[:2] + [("/usr/lib/python3.11/selectors.py", 468, "select", "fd_event_list = ...")]
    assert hang_report("call", 120, deeper).splitlines()[1:] == [
        "waiting at live.py:70 in wait_ready: time.sleep(0.25)", "inside select (selectors.py:468)"]


def test_a_real_hang_is_reported_by_phase(pytester, monkeypatch, tmp_path):
    """A fixture that never returns, under a guard of 1 s: the failure names setup and the waiting line."""
    import tests.budget as budget_module

    monkeypatch.setattr(budget_module, "RESULTS", tmp_path / "suite-times.json")
    monkeypatch.setattr(budget_module, "TEST_TIMEOUT_S", {"unit": 1, "integration": 1, "e2e": 1})
    monkeypatch.setattr(budget_module, "_OWN_CODE", (str(pytester.path),))
    unit = pytester.path / "unit"
    unit.mkdir()
    (unit / "test_hang.py").write_text(textwrap.dedent("""
        import threading
        import pytest

        @pytest.fixture
        def app():
            threading.Event().wait()  # an app that never comes up

        def test_uses_app(app):
            pass
        """))
    result = pytester.runpytest_inprocess("-p", "tests.budget", "-p", "no:cacheprovider", str(unit))
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*hit its 1s hang guard in setup*",
                                 "*waiting at test_hang.py:7 in app: threading.Event().wait()*"])
