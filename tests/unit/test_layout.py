"""The source layout: platform/ is a source root, never a package (a platform/__init__.py would shadow
the stdlib module), and every module of shunter belongs to a room of the import contracts. The contracts
themselves are checked on the installed layout (tests/unit/test_packaging.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_platform_is_not_a_package():
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_stdlib_platform_works_from_repo_root():
    out = subprocess.run(
        [sys.executable, "-c", "import platform, uuid; print(platform.system())"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "Linux"


def test_every_module_of_shunter_is_in_a_room():
    """The import contracts list the core module by module; a new core module missing from that list
    would escape them. Every child of `shunter` is the CLI, a user room, or listed as core."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    core = set(next(c for c in config["contracts"] if c["name"].startswith("the core"))["source_modules"])
    rooms = {"shunter.cli", "shunter.deployments", "shunter.routing", "shunter.ops"}
    children = {f"shunter.{path.stem if path.suffix == '.py' else path.name}"
                for path in (ROOT / "platform" / "shunter").iterdir()
                if not path.name.startswith("__") and (path.suffix == ".py" or (path / "__init__.py").exists())}
    children |= {"shunter.deployments", "shunter.routing", "shunter.ops"}
    assert children - rooms == core, f"not in a room: {sorted(children - rooms - core)}; " \
                                     f"listed but gone: {sorted(core - (children - rooms))}"


@pytest.mark.parametrize("room", ["routing", "ops", "deployments"])
def test_a_room_imports_only_under_shunter(room):
    """From the repository root (where a script or `python -c` puts the folder on sys.path) a room's folder
    is also a top-level package: imported bare, it would be a second copy of every module (two routing
    states, two metric registries). Each room refuses that, and imports as shunter.<room>."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bare = subprocess.run([sys.executable, "-c", f"import {room}"], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    assert bare.returncode != 0, f"`import {room}` from the repository root worked"
    assert f"ImportError: import shunter.{room}, not {room}: the same file under two names is two modules" \
        in bare.stderr, bare.stderr
    proper = subprocess.run([sys.executable, "-c", f"import shunter.{room} as m; print(m.__name__)"], cwd=ROOT,
                            env=env, capture_output=True, text=True)
    assert proper.returncode == 0 and proper.stdout.strip() == f"shunter.{room}", proper.stderr
