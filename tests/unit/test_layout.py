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
