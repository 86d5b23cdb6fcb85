"""The admin API's request bodies (and the Batch API's create body), as typed models with bounds: parsed once, refused with a 400 naming the
field otherwise. Non-finite numbers never get in (the JSON reader refuses NaN and Infinity, and these
models refuse them again), so nothing an operator sends can turn a traffic weight into NaN.

The same models describe the bodies in the gateway's OpenAPI document, so the schema fuzzers exercise
them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from shunter.batch_files import BATCH_ENDPOINTS
from shunter.config.adapters import AdapterConfig
from shunter.errors import ApiError, validation_error_body

MAX_WEIGHT = 1_000_000.0
MAX_DRAIN_TIMEOUT_S = 86_400.0


class _AdminBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class WeightsBody(_AdminBody):
    """PUT /admin/models/{model}/weights."""

    weights: dict[str, float] = Field(
        min_length=1, description="Version name: weight (0 to 1,000,000). Versions above 0 run; the rest retire.")

    @field_validator("weights")
    @classmethod
    def _bounded(cls, weights: dict[str, float]) -> dict[str, float]:
        bad = {v: w for v, w in weights.items() if not 0 <= w <= MAX_WEIGHT}
        if bad:
            raise ValueError(f"weights are from 0 to {MAX_WEIGHT:g}; got {bad}")
        if sum(weights.values()) <= 0:
            raise ValueError("at least one version needs a weight above 0")
        return weights


class DrainBody(_AdminBody):
    """POST /admin/models/{model}/replicas/{replica}/drain (every field optional)."""

    replace: StrictBool = Field(default=True, description="Replace the replica once it is idle.")
    force: StrictBool = Field(default=False, description="Drain even the last routable replica.")
    timeout_s: float | None = Field(
        default=None, ge=0, le=MAX_DRAIN_TIMEOUT_S,
        description="Retire at the latest after this many seconds (default: the model's draining.timeout_s).")


class AdapterBody(AdapterConfig):
    """POST /admin/models/{model}/adapters: a LoRA adapter to serve (or new files for one served), checked
    as the config file's `adapters:` entries are (a name without `:`, a directory with adapter_config.json
    on every node that runs the model)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class RolloutStartBody(BaseModel):
    """POST /admin/rollouts/{model}: the version to roll out to, plus any of the model's `rollout` settings
    for this rollout only (checked as the config file's `rollout:` section is)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    to: str = Field(min_length=1, max_length=200, description="The version to roll out to.")


class AdapterRolloutBody(BaseModel):
    """POST /admin/models/{model}/adapters/{adapter}/rollout: the adapter's new files, plus any of the
    model's `rollout` settings for this rollout only."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    source: str = Field(min_length=1, max_length=4096, description="The new version's adapter directory.")


class CreateBatchBody(_AdminBody):
    """POST /v1/batches (OpenAI's Batch API)."""

    input_file_id: str = Field(min_length=1, max_length=64, description="An uploaded file of purpose `batch`.")
    endpoint: Literal[tuple(BATCH_ENDPOINTS)] = Field(  # type: ignore[valid-type]
        description="The endpoint every line calls (each line's `url`).")
    completion_window: Literal["24h"] = Field(description="How long the batch may take; lines not run by then "
                                              "end as `batch_expired` error lines.")
    metadata: dict[str, str] | None = Field(
        default=None, max_length=16, description="Up to 16 pairs, keys up to 64 and values up to 512 characters.")

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (metadata or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError("keys are up to 64 characters and values up to 512")
        return metadata


def parse_body(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """`body` as `model`, or a 400 naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ApiError.from_body(400, validation_error_body(exc)) from None


ADMIN_BODIES: tuple[type[BaseModel], ...] = (WeightsBody, DrainBody, RolloutStartBody, AdapterBody,
                                             AdapterRolloutBody, CreateBatchBody)
