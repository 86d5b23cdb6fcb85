"""platform/ is a source root, never a package: a platform/__init__.py would shadow the stdlib module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_platform_is_not_a_package():
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_stdlib_platform_works_from_repo_root():
    out = subprocess.run(
        [sys.executable, "-c", "import platform, uuid; print(platform.system())"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "Linux"


def test_layers_import_in_the_documented_direction():
    """shunter core imports nothing of ours; routing/ and ops/ import only the core.

    The CLI face (the package platform/shunter/cli/) is the one exception: it may import everything,
    lazily; and no other module imports it.
    """
    core = ROOT / "platform" / "shunter"
    for path in core.rglob("*.py"):
        if path.relative_to(core).parts[0] == "cli":
            continue
        assert "shunter.cli" not in path.read_text(), f"{path} imports the CLI"
        text = path.read_text()
        for other in ("deployments", "routing", "ops"):
            assert f"from {other}" not in text and f"import {other}" not in text, f"{path} imports {other}"
    for room in ("routing", "ops"):
        for path in (ROOT / room).rglob("*.py"):
            assert "from deployments" not in path.read_text(), f"{path} imports deployments"


def test_the_import_contracts_in_pyproject_hold():
    """[tool.importlinter] in pyproject.toml: which room may import which, imports inside functions too."""
    done = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--config", "pyproject.toml",
                           "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " 0 broken" in done.stdout and "broken" in done.stdout


def test_no_module_of_ours_is_in_an_import_circle():
    """Tarjan's strongly connected components over every import of ours (grimp's graph, the one
    import-linter checks): a component of more than one module is a circle."""
    import grimp

    graph = grimp.build_graph("shunter", "deployments", "routing", "ops", cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) & graph.modules for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in edges[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while (top := stack.pop()) != module:
                component.append(top)
            if component:
                circles.append(sorted([module, *component]))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"
