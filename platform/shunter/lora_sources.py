"""Where a LoRA adapter's files come from: a local directory, or an object store (`s3://`, `gs://`).

A remote adapter is copied by the replica that first needs it into a cache on its node
(`$SHUNTER_CACHE_DIR/adapters`, next to the prepared models), and served from there; other replicas on
the node reuse the copy (shunter.object_store: credentials from the node's environment, never the config;
a remote source is immutable, so a copy never goes stale). New weights are published under a new URI and
rolled out to it (a rollout moves an adapter between sources).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shunter import object_store
from shunter.object_store import REMOTE_SCHEMES, ObjectStoreError, is_remote

__all__ = ["ADAPTER_CONFIG", "MAX_ADAPTER_BYTES", "REMOTE_SCHEMES", "AdapterSourceError", "cache_dir",
           "check_remote_uri", "fetch", "is_remote", "local_copy", "remote_adapter_config"]

ADAPTER_CONFIG = "adapter_config.json"
# An adapter is an adapter_config.json and its weights (tens of MB for rank 8-64 on 8B models); a
# directory with more than this is not an adapter, and fetching it whole would fill the node's disk.
MAX_ADAPTER_BYTES = 4 << 30


class AdapterSourceError(Exception):
    """An adapter source that cannot be used; the message says why, fit for an operator."""


def check_remote_uri(source: str) -> str:
    """`source` if it is a usable object-store URI; raises ValueError (a config error) otherwise."""
    return object_store.check_remote_uri(source, "an adapter")


def cache_dir() -> Path:
    env = os.environ.get("SHUNTER_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(env).expanduser() if env else (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "shunter"
    return base / "adapters"


def local_copy(source: str) -> Path:
    """Where the node keeps its copy of remote `source`."""
    return object_store.local_copy(source, cache_dir())


def remote_adapter_config(source: str) -> dict[str, Any]:
    """The adapter_config.json of remote `source`, read without fetching the weights (for checks at the
    door: an admin call learns at once that the adapter is missing or too big for the engine)."""
    try:
        data = object_store.read_file(source, ADAPTER_CONFIG)
    except FileNotFoundError:
        raise AdapterSourceError(f"{source} holds no {ADAPTER_CONFIG}: not a LoRA adapter") from None
    except ObjectStoreError as exc:  # unreachable store, or denied
        raise AdapterSourceError(str(exc)) from None
    try:
        config = json.loads(data)
    except ValueError as exc:
        raise AdapterSourceError(f"cannot read {source}/{ADAPTER_CONFIG}: {type(exc).__name__}: {exc}"[:400]) \
            from None
    if not isinstance(config, dict):
        raise AdapterSourceError(f"{source}/{ADAPTER_CONFIG} is not a JSON object")
    return config


def fetch(source: str) -> str:
    """A local directory with remote `source`'s files, copied on first use. Blocking: call it off the
    event loop."""
    target = local_copy(source)
    if (target / ADAPTER_CONFIG).is_file():
        return str(target)
    remote_adapter_config(source)  # a clear reason when the source is no adapter, before any transfer
    try:
        return str(object_store.fetch_folder(source, cache_dir(), ADAPTER_CONFIG, "an adapter", MAX_ADAPTER_BYTES))
    except ObjectStoreError as exc:
        raise AdapterSourceError(str(exc)) from None
