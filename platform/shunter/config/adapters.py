"""`adapters:` of a model: LoRA fine-tunes served on its replicas, by name.

A client names an adapter as `model` (its own name, or `<base>:<adapter>`); the replica runs the base
model's engine with LoRA enabled and loads an adapter the first time a request names it (vLLM keeps the
most recently used ones: `engine.max_loras` in the engine at once, `engine.max_cpu_loras` in host memory).
Adapter names share the namespace of model names and aliases. Each is one URL path segment (the admin API's
`/admin/models/{model}/adapters/{name}` carries it), so it is checked by `adapter_name_problem` alone,
wherever a name comes from: the config, the admin API, an `adapter_dirs` scan.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import Field, field_validator

from shunter.config.base import StrictModel
from shunter.lora_sources import check_remote_uri, is_remote

# One URL path segment: no `/` (a route cannot carry it), no `:` (`<base>:<adapter>` splits on it), never `.`
# or `..` (clients and proxies fold dot segments), at most 128 characters.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
ADAPTER_NAME_RULE = ("letters, digits, '.', '_' and '-', starting with a letter or digit, at most 128 characters "
                     f"(pattern {ADAPTER_NAME_PATTERN})")
_ADAPTER_NAME = re.compile(ADAPTER_NAME_PATTERN.removeprefix("^").removesuffix("$"))


def adapter_name_problem(name: object) -> str | None:
    """Why `name` cannot be an adapter's name, or None: the one check of the config, the admin API and the
    `adapter_dirs` scan. The reason never repeats the name (it may be anything a client sent)."""
    if isinstance(name, str) and _ADAPTER_NAME.fullmatch(name):
        return None
    return f"an adapter name is {ADAPTER_NAME_RULE}"


class AdapterConfig(StrictModel):
    """One LoRA adapter of a base model."""

    name: str = Field(json_schema_extra={"pattern": ADAPTER_NAME_PATTERN},
                      description="What clients put in `model` (or `<base>:<name>`); listed by /v1/models; "
                      f"{ADAPTER_NAME_RULE}: one segment of an admin API path.")
    source: str = Field(description="The adapter's directory (PEFT's adapter_config.json and weights): a local "
                        "path on every node that runs a replica of the base model, or an object-store folder "
                        "(s3://bucket/folder, gs://bucket/folder) the replicas fetch on first use, with the "
                        "nodes' own credentials.")

    @field_validator("name")
    @classmethod
    def _name_is_url_safe(cls, value: str) -> str:
        problem = adapter_name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

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
