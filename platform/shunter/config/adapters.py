"""`adapters:` of a model: LoRA fine-tunes served on its replicas, by name.

A client names an adapter as `model` (its own name, or `<base>:<adapter>`); the replica runs the base
model's engine with LoRA enabled and loads an adapter the first time a request names it (vLLM keeps the
most recently used ones: `engine.max_loras` in the engine at once, `engine.max_cpu_loras` in host memory).
Adapter names share the namespace of model names and aliases, and cannot hold `:`.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, field_validator

from shunter.adapter_sources import check_remote_uri, is_remote
from shunter.config.base import StrictModel

ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"  # a model name without `:` (base:adapter splits on it)


class AdapterConfig(StrictModel):
    """One LoRA adapter of a base model."""

    name: str = Field(pattern=ADAPTER_NAME_PATTERN, max_length=128,
                      description="What clients put in `model` (or `<base>:<name>`); listed by /v1/models.")
    source: str = Field(description="The adapter's directory (PEFT's adapter_config.json and weights): a local "
                        "path on every node that runs a replica of the base model, or an object-store folder "
                        "(s3://bucket/folder, gs://bucket/folder) the replicas fetch on first use, with the "
                        "nodes' own credentials.")

    @field_validator("source")
    @classmethod
    def _source_is_an_adapter(cls, value: str) -> str:
        if is_remote(value):  # checked where it is fetched (the door and the replicas have the credentials)
            return check_remote_uri(value)
        path = Path(value).expanduser()
        if not (path / "adapter_config.json").is_file():
            raise ValueError(f"{value!r} is not a LoRA adapter directory (no adapter_config.json in it)")
        return str(path.resolve())

    def rank(self) -> int | None:
        """The adapter's LoRA rank, from its local adapter_config.json (None when it does not say, or the
        adapter is in an object store)."""
        if is_remote(self.source):
            return None
        try:
            rank = json.loads((Path(self.source) / "adapter_config.json").read_text()).get("r")
        except (OSError, ValueError):
            return None
        return rank if isinstance(rank, int) else None
