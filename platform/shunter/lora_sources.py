"""Where a LoRA adapter's files come from: a local directory, or an object store (`s3://`, `gs://`).

A remote adapter is fetched by the replica that first needs it, into a cache on its node
(`$SHUNTER_CACHE_DIR/adapters`, next to the prepared models), and served from there; other replicas on
the node reuse the copy. Credentials and endpoints come from the node's environment, the way the object
store's own clients find them (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL / AWS_REGION or
an instance role; GOOGLE_APPLICATION_CREDENTIALS or the metadata server), never from the config: a URI with
credentials in it is refused, since sources are shown to operators (`GET /admin/models/{m}/adapters`).

A remote source is immutable: new weights are published under a new URI and rolled out to it (a rollout
moves an adapter between sources), so a fetched copy never goes stale. The transfer is Arrow's filesystem
layer (`pyarrow.fs`, which Ray already brings): S3 and GCS in one well-kept client.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REMOTE_SCHEMES = ("s3", "gs", "gcs")
ADAPTER_CONFIG = "adapter_config.json"
# An adapter is an adapter_config.json and its weights (tens of MB for rank 8-64 on 8B models); a
# directory with more than this is not an adapter, and fetching it whole would fill the node's disk.
MAX_ADAPTER_BYTES = 4 << 30


class AdapterSourceError(Exception):
    """An adapter source that cannot be used; the message says why, fit for an operator."""


def is_remote(source: str) -> bool:
    return urlsplit(source).scheme in REMOTE_SCHEMES


def check_remote_uri(source: str) -> str:
    """`source` if it is a usable object-store URI; raises ValueError (a config error) otherwise."""
    parts = urlsplit(source)
    if parts.username or parts.password:
        raise ValueError("credentials do not belong in an adapter's source (operators see it): give the nodes "
                         "the object store's own environment (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                         "or an instance role)")
    if not parts.netloc or not parts.path.strip("/"):
        raise ValueError(f"{source!r} names no bucket and folder: write {parts.scheme}://<bucket>/<folder>")
    return source


def cache_dir() -> Path:
    env = os.environ.get("SHUNTER_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(env).expanduser() if env else (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "shunter"
    return base / "adapters"


def local_copy(source: str) -> Path:
    """Where the node keeps its copy of remote `source`."""
    return cache_dir() / hashlib.blake2b(source.encode(), digest_size=10).hexdigest()


def _filesystem(source: str) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(source.rstrip("/"))
    except Exception as exc:  # noqa: BLE001 - Arrow's reason, which names the problem
        raise AdapterSourceError(f"cannot open {source}: {exc}") from None


def remote_adapter_config(source: str) -> dict[str, Any]:
    """The adapter_config.json of remote `source`, read without fetching the weights (for checks at the
    door: an admin call learns at once that the adapter is missing or too big for the engine)."""
    filesystem, path = _filesystem(source)
    try:
        with filesystem.open_input_stream(f"{path}/{ADAPTER_CONFIG}") as stream:
            config = json.loads(stream.read(1 << 20))
    except FileNotFoundError:
        raise AdapterSourceError(f"{source} holds no {ADAPTER_CONFIG}: not a LoRA adapter") from None
    except Exception as exc:  # noqa: BLE001 - unreachable store, denied, or not JSON
        raise AdapterSourceError(f"cannot read {source}/{ADAPTER_CONFIG}: {type(exc).__name__}: {exc}"[:400]) from None
    if not isinstance(config, dict):
        raise AdapterSourceError(f"{source}/{ADAPTER_CONFIG} is not a JSON object")
    return config


def fetch(source: str) -> str:
    """A local directory with remote `source`'s files, fetched on first use. Blocking: call it off the
    event loop. Replicas on one node may fetch at once; each writes a folder of its own and the first to
    finish publishes it (a rename), so nobody ever reads a half-written copy."""
    target = local_copy(source)
    if (target / ADAPTER_CONFIG).is_file():
        return str(target)
    import pyarrow.fs as pafs

    remote_adapter_config(source)  # a clear reason when the source is no adapter, before any transfer
    filesystem, path = _filesystem(source)
    try:
        files = filesystem.get_file_info(pafs.FileSelector(path, recursive=True))
    except Exception as exc:  # noqa: BLE001
        raise AdapterSourceError(f"cannot list {source}: {type(exc).__name__}: {exc}"[:400]) from None
    size = sum(f.size or 0 for f in files if f.type == pafs.FileType.File)
    if size > MAX_ADAPTER_BYTES:
        raise AdapterSourceError(f"{source} holds {size / 2**30:.1f} GiB, more than an adapter "
                                 f"({MAX_ADAPTER_BYTES / 2**30:.0f} GiB at most)")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        pafs.copy_files(path, str(staging), source_filesystem=filesystem, use_threads=False)
        if not (staging / ADAPTER_CONFIG).is_file():
            raise AdapterSourceError(f"{source} changed while it was fetched: {ADAPTER_CONFIG} is missing")
        try:
            staging.rename(target)
        except OSError:  # another replica on this node published it first
            if not (target / ADAPTER_CONFIG).is_file():
                raise
    except AdapterSourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - a transfer that failed halfway
        raise AdapterSourceError(f"fetching {source} failed: {type(exc).__name__}: {exc}"[:400]) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)
