"""How a model's replicas follow its load: autoscaling, admission (the queue bound), draining."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from shunter.config.base import StrictModel


class AutoscalingConfig(StrictModel):
    """Replicas of this model follow the work waiting for them: the engines' queues (waiting + running
    requests each replica reports) plus requests queued ahead of the replicas."""

    min_replicas: int = Field(default=1, ge=0, le=1024, description="Fewest replicas; 0 allows scale to zero.")
    max_replicas: int = Field(default=2, ge=1, le=1024, description="Most replicas.")
    target_queue_per_replica: float = Field(
        default=16, gt=0, description="Requests (waiting + running in the engine) one replica should carry."
    )
    upscale_delay_s: float = Field(
        default=10.0, ge=0, description="How long the need for more replicas must last before scaling up."
    )
    downscale_delay_s: float = Field(
        default=60.0, ge=0, description="How long the need for fewer replicas must last before scaling down."
    )
    batch_max_replicas: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Most replicas the work of the batch classes (those less urgent than "
        "`flow_control.default_class`) scales the model to on its own: it soaks up idle capacity and uses "
        "replicas the other classes' demand started, but does not start more than this. Default: "
        "min_replicas (at least 1, so batch work alone can wake a model scaled to zero). The other classes "
        "scale up to max_replicas as before.",
    )
    cold_start_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="min_replicas 0 only: how long a request to a model scaled to zero is held while a "
        "replica starts; then 503 with Retry-After. An engine start on CPU takes about a minute.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if self.batch_max_replicas is not None and self.batch_max_replicas > self.max_replicas:
            raise ValueError(f"batch_max_replicas ({self.batch_max_replicas}) exceeds max_replicas "
                             f"({self.max_replicas})")
        return self

    @property
    def batch_replicas(self) -> int:
        """The most replicas batch work alone scales to."""
        return self.batch_max_replicas if self.batch_max_replicas is not None else max(1, self.min_replicas)


class AdmissionConfig(StrictModel):
    """How much work may wait for this model before new requests are turned away."""

    max_queued_requests: int = Field(
        default=128,
        ge=0,
        description="Requests that may wait for a replica slot beyond what the running replicas take at "
        "once (replicas x max_ongoing_requests). Past it, new requests get 429 with Retry-After; admitted "
        "requests are never affected. Split evenly across gateway replicas.",
    )
    max_wait_s: float | None = Field(
        default=None,
        gt=0,
        description="Longest a new request is expected to wait for a replica slot (a time-to-first-token "
        "budget): past it, it gets 429 even below max_queued_requests. The expected wait is the requests "
        "queued ahead of it over the rate admitted requests have been finishing (once at least 8 finished "
        "in the last 30 s). Whether or not this is set, a request is never admitted to wait longer than "
        "gateway.queue_timeout_s, which would end it with 503 queue_timeout after that wait.",
    )


class DrainingConfig(StrictModel):
    """What happens to a replica that leaves: scale-down, update, version retirement, shutdown."""

    timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="How long a leaving replica's in-flight requests and streams may run on; then they are "
        "aborted with a `replica_drain_timeout` error. The default covers a full 2,048-token stream at the "
        "~13 tokens/s a stream gets on a fully loaded CPU engine (about 160 s), with room to spare.",
    )
    surge_percent: int | Literal["auto"] = Field(
        default="auto",
        description="Replicas replaced by an update start before the old ones stop, up to this share "
        "(0-100) of the replica count (Ray Serve's max_surge_percent); 0 = stop first, then start (Ray's "
        "default: a one-replica model serves nothing meanwhile). auto = 100, except on CPU when the node "
        "has no spare cores for the extra replicas (a replacement that cannot be placed would stall the "
        "update), then 0.",
    )

    @field_validator("surge_percent")
    @classmethod
    def _surge_range(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 0 <= value <= 100:
            raise ValueError("must be 0-100, or 'auto'")
        return value
