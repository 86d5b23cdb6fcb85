"""The source layout: platform/ is a source root, never a package (a platform/__init__.py would shadow
the stdlib module), and every module of shunter belongs to a room of the import contracts. The contracts
themselves are checked on the installed layout (tests/unit/test_packaging.py)."""

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
