"""What `pip install` gives a user: one import root, `shunter`, whatever the repository's folders.

The repository keeps the card's folders (platform/shunter, deployments/, routing/, ops/) and pyproject's
package-dir mapping installs them as shunter, shunter.deployments, shunter.routing and shunter.ops. The
wheel is built from a copy of the sources the build needs and installed into a clean virtualenv; the
import contracts and the no-circle check run against that installed tree, because grimp (import-linter's
graph) finds a package's modules by walking its one directory, which only the installed layout has.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Where each room of the repository installs.
ROOMS = {"shunter": ROOT / "platform" / "shunter", "shunter/deployments": ROOT / "deployments",
         "shunter/routing": ROOT / "routing", "shunter/ops": ROOT / "ops"}


class Installed:
    def __init__(self, venv: Path):
        self.venv = venv
        purelib = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
        self.site = Path(purelib)

    def run(self, *argv: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
        """A command of the main virtualenv with only the clean install's `shunter` importable."""
        return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(self.site)})


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("pyproject.toml", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    for folder in ("platform/shunter", "deployments", "routing", "ops"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    subprocess.run([str(BIN / "pip"), "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "dist"), str(src)], check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp / "dist").glob("shunter-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    subprocess.run([str(BIN / "pip"), "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, timeout=120)
    return Installed(venv)


def test_the_install_puts_only_shunter_in_site_packages(installed):
    names = {path.name for path in installed.site.iterdir()}
    assert names == {"shunter", "shunter-0.1.0.dist-info"}
    scripts = {path.name for path in (installed.venv / "bin").iterdir()}
    assert "shunter" in scripts and not scripts - {"shunter", "python", "python3", f"python3.{sys.version_info[1]}",
                                                     "activate", "activate.csh", "activate.fish", "Activate.ps1"}


def test_every_module_of_every_room_is_installed_under_shunter(installed):
    """A package missing from pyproject's list would leave its modules out of the wheel."""
    for target, source in ROOMS.items():
        want = {path.relative_to(source) for path in source.rglob("*.py") if "__pycache__" not in path.parts}
        got = {path.relative_to(installed.site / target) for path in (installed.site / target).rglob("*.py")}
        if target == "shunter":  # the other rooms install inside it
            got = {path for path in got if path.parts[0] not in ("deployments", "routing", "ops")}
        assert want == got, f"{target}: missing {sorted(map(str, want - got))}, extra {sorted(map(str, got - want))}"


def test_the_installed_package_imports_from_any_directory(installed, tmp_path):
    """What a Serve replica does with the config's import_path, outside the repository."""
    deps = installed.site / "deps.pth"  # the main virtualenv's libraries (Ray, vLLM), not its shunter
    deps.write_text("".join(f"{entry}\n" for entry in sys.path if entry.endswith("site-packages")))
    try:
        done = subprocess.run([str(installed.venv / "bin" / "python"), "-c",
                               "import shunter.deployments.app as app, shunter.routing.routers, shunter.ops.autoscaling;"
                               "print(app.__file__, callable(app.build_app))"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == [str(installed.site / "shunter" / "deployments" / "app.py"), "True"]
        done = subprocess.run([str(installed.venv / "bin" / "shunter"), "config", "check",
                               str(ROOT / "configs" / "local.yaml")], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "import_path" not in done.stderr
    finally:
        deps.unlink()


def test_the_import_contracts_in_pyproject_hold(installed):
    """[tool.importlinter] in pyproject.toml: which room may import which, imports inside functions too."""
    done = installed.run(str(BIN / "lint-imports"), "--config", str(ROOT / "pyproject.toml"), "--no-cache",
                         cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " 0 broken" in done.stdout and "7 kept" in done.stdout, done.stdout[-2000:]


def test_no_module_of_ours_is_in_an_import_circle(installed):
    """Tarjan's strongly connected components over every import of ours (grimp's graph, the one
    import-linter checks): a component of more than one module is a circle."""
    done = installed.run(str(BIN / "python"), "-c",
                         "import grimp, json; g = grimp.build_graph('shunter', cache_dir=None);"
                         "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))",
                         cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    edges = {module: set(imported) for module, imported in json.loads(done.stdout).items()}
    assert "shunter.deployments.gateway.deployment" in edges and "shunter.ops.autoscaling" in edges
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in edges[module] & edges.keys():
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
