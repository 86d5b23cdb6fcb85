"""`usage:` and a model's `pricing:`: the usage ledger (tokens and cost per tenant) and what a model's tokens cost.

Every request that settles writes one record (key, model, adapter, priority class, endpoint, tokens, cost;
refusals counted per minute) to a durable ledger: SQLite on the Ray head node behind one Serve deployment (shunter.deployments.ledger),
written in batches by each gateway off the request path (shunter.deployments.gateway.usage). `pricing` is
optional per model; without it a model's records carry tokens and no cost.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from shunter.config.base import StrictModel

DEFAULT_LEDGER_PATH = "~/.shunter/usage.sqlite3"


class PricingConfig(StrictModel):
    """What a model's tokens cost, per million tokens, in any one currency (e.g. USD) you choose; the ledger
    and /admin/usage report cost in that unit."""

    input_per_million: float = Field(
        ge=0, description="Price of one million prompt tokens the engine did not have cached (e.g. USD).")
    cached_input_per_million: float | None = Field(
        default=None, ge=0,
        description="Price of one million prompt tokens the engine's prefix cache already held (the usage's "
        "prompt_tokens_details.cached_tokens). null = the same as input_per_million.",
    )
    output_per_million: float = Field(ge=0, description="Price of one million generated tokens (e.g. USD).")

    @property
    def cached_price(self) -> float:
        return self.input_per_million if self.cached_input_per_million is None else self.cached_input_per_million


class UsageConfig(StrictModel):
    """The usage ledger: one record per settled request, kept in SQLite on the Ray head node."""

    enabled: bool = Field(
        default=True,
        description="Record every settled request's usage in the ledger (GET /admin/usage, and each key's own "
        "through GET /v1/organization/usage/completions). Off: no ledger deployment runs and both answer 503; "
        "the per-key usage metrics are still exported.",
    )
    path: str = Field(
        default=DEFAULT_LEDGER_PATH, min_length=1,
        description="The ledger's SQLite file, on the Ray head node (`~` is that node's home). Put it on a "
        "persistent volume: `shunter render kuberay` mounts one at /home/ray/.shunter on the head pod. An "
        "absolute path or one starting with `~`.",
    )
    flush_interval_s: float = Field(
        default=1.0, gt=0, le=60,
        description="How often each gateway sends the records it buffered to the ledger (one batch per "
        "call). A gateway that stops gracefully sends what it still holds first.",
    )
    max_batch_records: int = Field(
        default=500, ge=1, le=100_000, description="At most this many records in one call to the ledger.")
    max_buffered_records: int = Field(
        default=100_000, ge=1, le=10_000_000,
        description="A gateway's memory bound while the ledger is unreachable, in records and refusal counters "
        "(a gateway counts its refusals per minute and kind instead of sending a record each): past it the "
        "oldest are dropped (their requests counted in shunter_usage_records_dropped_total).",
    )

    retention_days: float | None = Field(
        default=90, gt=0, le=36_500,
        description="Rows older than this many days are deleted: when the ledger starts and then at most once "
        "an hour. null = keep every row (the file then grows with the traffic; see max_size_mb).",
    )
    max_size_mb: float | None = Field(
        default=None, gt=0, le=10_000_000,
        description="The ledger file's bound in MiB (SQLite's max_page_count; its write-ahead log adds a few MiB "
        "beside it). A file at the bound, or on a full disk, holds new usage in memory, summed per minute, and "
        "writes it once the file takes writes again (retention freed rows, or disk space was freed); "
        "shunter_usage_ledger_degraded is 1 meanwhile and queries include what is held. A stopping ledger "
        "writes what it holds past the bound. A bound below the file's current size is that size. null = the "
        "disk's size.",
    )

    @field_validator("path")
    @classmethod
    def _anchored(cls, value: str) -> str:
        if not (value.startswith("/") or value.startswith("~")):
            raise ValueError("must be an absolute path or start with `~` (a relative one would land in Ray's "
                             "per-session working directory and be lost with it)")
        if "\x00" in value:
            raise ValueError("must not contain a NUL byte")
        return value
