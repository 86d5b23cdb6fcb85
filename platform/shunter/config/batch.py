"""`batch:`: OpenAI's Files and Batch APIs (`/v1/files`, `/v1/batches`).

Uploaded files and batch state live on the Ray head node behind one Serve deployment
(shunter.deployments.batch): the state in SQLite by default or in PostgreSQL, the files' bytes in a folder
or an object store (shunter.batch_store, shunter.batch_files).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, field_validator

from shunter.config.base import StrictModel
from shunter.object_store import check_remote_uri, is_remote

DEFAULT_STATE = "~/.shunter/batch.sqlite3"
DEFAULT_FILES = "~/.shunter/files"
MIB = 1 << 20


class BatchConfig(StrictModel):
    """Files and batches, per client key."""

    enabled: bool = Field(
        default=True,
        description="Serve /v1/files and /v1/batches (OpenAI's Files and Batch APIs). Off: no batch deployment "
        "runs and their routes answer 404.",
    )
    state: str = Field(
        default=DEFAULT_STATE, min_length=1,
        description="Where files' records and batches' state are kept: a SQLite file on the Ray head node (an "
        "absolute path or one starting with `~`; put it on a persistent volume: `shunter render kuberay` "
        "mounts one at /home/ray/.shunter), or a PostgreSQL URL (`postgresql://user@host:5432/db`, the "
        "password from PGPASSWORD or ~/.pgpass on the head node, never in the config).",
    )
    files: str = Field(
        default=DEFAULT_FILES, min_length=1,
        description="Where uploaded files' bytes are kept: a folder on the Ray head node (absolute or `~`), or "
        "an object-store prefix (`s3://bucket/prefix`, `gs://...`; credentials from the head node's environment).",
    )
    max_file_bytes: int = Field(
        default=200 * MIB, ge=1, le=8 * 1024 * MIB,
        description="The largest file an upload may carry (OpenAI's batch input limit is 200 MB); a larger "
        "upload is refused with 413.",
    )
    max_lines: int = Field(
        default=50_000, ge=1, le=10_000_000,
        description="The most requests one batch input file may hold (OpenAI's limit: 50,000).",
    )

    max_lines_in_flight: int = Field(
        default=16, ge=1, le=4096,
        description="The most batch lines running at once, every key's together. Lines run in the least "
        "urgent priority class (flow_control.classes' last), so they wait behind interactive requests and "
        "fill only that class's capacity_share of a model's slots however high this is.",
    )
    max_lines_in_flight_per_key: int = Field(
        default=8, ge=1, le=4096,
        description="The most lines of one key's batches running at once: keys with batches take turns, so "
        "one key's large batch never holds the slots another key's batch waits for.",
    )

    @field_validator("state")
    @classmethod
    def _state_where(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("must not contain a NUL byte")
        if value.startswith("postgresql://"):
            if urlsplit(value).password is not None:
                raise ValueError("a PostgreSQL URL must not carry a password: give it in PGPASSWORD or "
                                 "~/.pgpass on the head node")
            return value
        if "://" in value:
            raise ValueError("must be a SQLite file path or a postgresql:// URL")
        if not (value.startswith("/") or value.startswith("~")):
            raise ValueError("must be an absolute path or start with `~` (a relative one would land in Ray's "
                             "per-session working directory and be lost with it)")
        return value

    @field_validator("files")
    @classmethod
    def _files_where(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("must not contain a NUL byte")
        if is_remote(value):
            return check_remote_uri(value, "the batch files")
        if not (value.startswith("/") or value.startswith("~")):
            raise ValueError("must be an absolute path, start with `~`, or be an s3:// or gs:// prefix")
        return value
