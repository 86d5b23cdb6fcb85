"""Folders in an object store (`s3://`, `gs://`), copied once per node into a local cache.

Model weights (`models[].source`) and LoRA adapters (`adapters[].source`) may live where fleets keep
them. A replica that needs a remote folder copies it into a cache on its node and serves from there;
other replicas on the node reuse the copy. Credentials and endpoints come from the node's environment,
the way the stores' own clients find them (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL /
AWS_REGION or an instance role; GOOGLE_APPLICATION_CREDENTIALS or the metadata server), never from the
config: a URI with credentials in it is refused, since sources are shown to operators.

A remote source is immutable: new weights are published under a new URI and rolled out to it, so a
copy never goes stale and its presence means it is whole. Replicas on one node may copy at once: each
writes a staging folder of its own and the first to finish publishes it with a rename, so nobody ever
reads a half-written copy. The transfer is Arrow's filesystem layer (`pyarrow.fs`, which Ray already
brings): S3 and GCS in one well-kept client.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REMOTE_SCHEMES = ("s3", "gs", "gcs")


class ObjectStoreError(Exception):
    """A remote folder that cannot be used; the message says why, fit for an operator."""


def is_remote(source: str) -> bool:
    return urlsplit(source).scheme in REMOTE_SCHEMES


def check_remote_uri(source: str, what: str) -> str:
    """`source` if it is a usable object-store URI for `what` ("an adapter", "a model"); raises ValueError
    (a config error) otherwise."""
    parts = urlsplit(source)
    if parts.username or parts.password:
        raise ValueError(f"credentials do not belong in {what}'s source (operators see it): give the nodes "
                         "the object store's own environment (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                         "or an instance role)")
    if not parts.netloc or not parts.path.strip("/"):
        raise ValueError(f"{source!r} names no bucket and folder: write {parts.scheme}://<bucket>/<folder>")
    return source


def local_copy(source: str, cache: Path) -> Path:
    """Where the node keeps its copy of remote `source`, under `cache`."""
    return cache / hashlib.blake2b(source.encode(), digest_size=10).hexdigest()


def filesystem(source: str) -> tuple[Any, str]:
    """Arrow's filesystem for `source` and the path inside it."""
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(source.rstrip("/"))
    except Exception as exc:  # noqa: BLE001 - Arrow's reason, which names the problem
        raise ObjectStoreError(f"cannot open {source}: {exc}") from None


def read_file(source: str, name: str, limit: int = 1 << 20) -> bytes:
    """File `name` of remote folder `source` (at most `limit` bytes), without copying the folder.
    FileNotFoundError when it is not there; ObjectStoreError when the store cannot be read."""
    store, path = filesystem(source)
    try:
        with store.open_input_stream(f"{path}/{name}") as stream:
            return stream.read(limit)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - unreachable store or denied
        raise ObjectStoreError(f"cannot read {source}/{name}: {type(exc).__name__}: {exc}"[:400]) from None


def fetch_folder(source: str, cache: Path, required: str, what: str, max_bytes: int | None = None) -> Path:
    """A local copy of remote folder `source` under `cache`, copied on first use. `required`: a file the
    folder must hold (checked before any transfer and again after it); `what` it is, for messages ("an
    adapter"); `max_bytes`: the most it may hold. Blocking: call it off the event loop."""
    target = local_copy(source, cache)
    if (target / required).is_file():
        return target
    import pyarrow.fs as pafs

    try:
        read_file(source, required, limit=1)
    except FileNotFoundError:
        raise ObjectStoreError(f"{source} holds no {required}: not {what}") from None
    store, path = filesystem(source)
    try:
        files = store.get_file_info(pafs.FileSelector(path, recursive=True))
    except Exception as exc:  # noqa: BLE001
        raise ObjectStoreError(f"cannot list {source}: {type(exc).__name__}: {exc}"[:400]) from None
    size = sum(f.size or 0 for f in files if f.type == pafs.FileType.File)
    if max_bytes is not None and size > max_bytes:
        raise ObjectStoreError(f"{source} holds {size / 2**30:.1f} GiB, more than {what} "
                               f"({max_bytes / 2**30:.0f} GiB at most)")
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if size > free:
        raise ObjectStoreError(f"{source} holds {size / 2**30:.1f} GiB; the node's cache {cache} has "
                               f"{free / 2**30:.1f} GiB free")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache))
    try:
        pafs.copy_files(path, str(staging), source_filesystem=store, use_threads=False)
        if not (staging / required).is_file():
            raise ObjectStoreError(f"{source} changed while it was copied: {required} is missing")
        try:
            staging.rename(target)
        except OSError:  # another replica on this node published it first
            if not (target / required).is_file():
                raise
    except ObjectStoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - a transfer that failed halfway
        raise ObjectStoreError(f"copying {source} failed: {type(exc).__name__}: {exc}"[:400]) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
