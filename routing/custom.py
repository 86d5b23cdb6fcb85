"""Any Ray Serve RequestRouter, by import path, behind Shunter's guard (policy `custom`).

Ray Serve takes a router as an import path and re-imports it, so the guarded class must be importable
by name. `guarded_path("pkg.mod:Router")` returns `shunter.routing.custom:G_<hex of the path>`; importing that
attribute (module `__getattr__`) imports the user's class and builds `Guarded<Router>(ShunterGuard,
Router)` once per process. The hex spelling keeps any import path a valid, reversible identifier.
"""

from __future__ import annotations

import importlib
from typing import Any

from shunter.routing.routers import ShunterGuard

_PREFIX = "G_"


def guarded_path(router_class: str) -> str:
    return f"{__name__}:{_PREFIX}{router_class.encode().hex()}"


def import_router(path: str) -> type:
    """The class at `pkg.mod:Class` or `pkg.mod.Class`; raises ImportError with the path on failure."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"cannot import router class {path!r}: {exc}") from exc
    if not isinstance(target, type):
        raise ImportError(f"{path!r} is not a class")
    return target


def __getattr__(name: str) -> type:
    if not name.startswith(_PREFIX):
        raise AttributeError(name)
    try:
        path = bytes.fromhex(name[len(_PREFIX):]).decode()
    except ValueError:
        raise AttributeError(name) from None
    router_cls = import_router(path)
    guarded = type(f"Guarded{router_cls.__name__}", (ShunterGuard, router_cls),
                   {"__module__": __name__, "__qualname__": name})
    globals()[name] = guarded
    return guarded
