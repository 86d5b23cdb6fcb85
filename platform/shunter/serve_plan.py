"""The plan behind build_app: where each model version runs and how many replicas it gets.

Pure decisions from the config and the cluster, made once before anything starts: each model's
accelerator, on CPU the cores each engine replica owns (a config whose CPU engines cannot all get their
cores on the node is refused: Ray would leave a replica pending forever), every GPU replica's placement,
the replica counts and autoscaling bounds, the surge a rollout may use. The gateway's app builder
(`shunter.deployments.app`) adds the Serve options that name its own rooms' classes (the request router,
the autoscaling policy) and the health and drain timings; `shunter plan` prints this plan without Ray.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from shunter import worker_fork
from shunter.config import DEFAULT_VERSION, ConfigError, ModelConfig, ShunterConfig
from shunter.cpu_cores import CoreDemand, core_headroom, core_shortfall, cores_per_replica
from shunter.engine_checks import engine_problems
from shunter.model_shape import model_shape, parallel_problems
from shunter.placement import (
    ClusterPlan,
    NodeSpec,
    PlacementError,
    declared_nodes,
    layout_of,
    plan_cluster,
    replica_demands,
)

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class ClusterView:
    """What the builder needs to know about the cluster it deploys to."""

    has_gpus: bool
    largest_node_cpus: int
    gpu_nodes: tuple[NodeSpec, ...] = ()  # the live GPU nodes, for placement checks
    # largest_node_cpus are all the cores the CPU engines can get (this machine, or a Ray cluster of one
    # node: nothing adds nodes), so engines that need more are refused; False on a cluster of several
    # nodes, which may hold or add more (a misfit only warns).
    cpus_fixed: bool = True
    cpu_node: str = "the node"  # where the CPU engines run, as messages name it

    @classmethod
    def detect(cls) -> ClusterView:
        """Read the connected Ray cluster; outside one (a dry build), describe this machine."""
        import ray

        if ray.is_initialized():
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            cpus = max((int(n["Resources"].get("CPU", 0)) for n in nodes), default=0)
            gpu_nodes = tuple(_node_spec(n) for n in nodes if n["Resources"].get("GPU", 0) > 0)
            one_node = len(nodes) == 1 and cpus > 0  # a KubeRay head alone has 0 CPUs: workers come later
            return cls(has_gpus=bool(gpu_nodes), largest_node_cpus=cpus or (os.cpu_count() or 1),
                       gpu_nodes=gpu_nodes, cpus_fixed=one_node,
                       cpu_node="the Ray node" if one_node else "the largest Ray node")
        return cls(has_gpus=False, largest_node_cpus=len(os.sched_getaffinity(0)), cpu_node="this machine")


def _node_spec(node: dict[str, Any]) -> NodeSpec:
    resources = node["Resources"]
    kinds = [key.split(":", 1)[1] for key in resources if key.startswith("accelerator_type:")]
    return NodeSpec(name=node["NodeID"], gpus=int(resources.get("GPU", 0)), cpus=int(resources.get("CPU", 0)),
                    accelerator_type=kinds[0] if kinds else None)


GATEWAY_DEPLOYMENT = "gateway"  # the gateway's deployment name (its handle is found by it: the batch service)


def deployment_name(model: ModelConfig, version: str = DEFAULT_VERSION) -> str:
    """Ray deployment names must be plain; hub ids like org/model are not. A model declared with
    `versions:` has one deployment per version."""
    base = "model-" + re.sub(r"[^A-Za-z0-9_-]+", "-", model.name)
    return f"{base}--{re.sub(r'[^A-Za-z0-9_-]+', '-', version)}" if model.versioned else base


def plan_deployments(cfg: ShunterConfig, cluster: ClusterView) -> dict[str, dict[str, dict[str, Any]]]:
    """Per model, per version: the deployment options and constructor settings. Pure: tested without a
    cluster. Cores are planned for every version that may run at once (during a rollout, the old and
    the new side by side)."""
    accelerators = {m.name: _accelerator(m, cluster) for m in cfg.models}
    check_placement(cfg, cluster, accelerators)
    cpu_models = [m for m in cfg.models if accelerators[m.name] == "cpu"]
    # Models on shared cores own none: the others split the node among themselves.
    cpu_replicas = sum(m.most_replicas * m.most_running_versions for m in cpu_models
                       if m.cpu_cores_per_replica != "shared")
    cpu_cores = {m.name: _cpu_cores(m, cluster, cpu_replicas) for m in cpu_models}
    spare_cores = cluster.largest_node_cpus - sum(cpu_cores[m.name] * m.most_replicas * m.most_running_versions
                                                  for m in cpu_models)
    plans: dict[str, dict[str, dict[str, Any]]] = {}
    names: dict[str, str] = {}
    for model in cfg.models:
        plans[model.name] = {}
        for version in model.version_names():
            name = deployment_name(model, version)
            if name in names:
                raise ConfigError(f"{names[name]} and {model.name!r} version {version!r} map to the same "
                                  f"deployment name {name!r}; rename one of them")
            names[name] = f"model {model.name!r} version {version!r}"
            plans[model.name][version] = _plan_version(model, version, name, accelerators[model.name],
                                                       cpu_cores.get(model.name), spare_cores)
    check_cpu_cores(cfg, cluster, cpu_core_demands(cfg, plans))
    return plans


def forks_workers(plans: dict[str, dict[str, dict[str, Any]]]) -> bool:
    """Whether every model replica is forked from its node's server (shunter.worker_fork): then the
    gateway's are too. Its cold start was the critical path of an app's deploy, 9 of its 13 s importing
    vLLM's request models, which the server already holds (a forked gateway imports about 1 s of Ray
    Serve's own). A GPU engine's replicas start cold, and so do the gateways beside them: the fork path
    is measured on CPU nodes only."""
    runtime_envs = [plan["deployment"]["ray_actor_options"].get("runtime_env", {})
                    for versions in plans.values() for plan in versions.values()]
    return bool(runtime_envs) and all(env.get("py_executable") == worker_fork.EXECUTABLE for env in runtime_envs)


def check_cpu_cores(cfg: ShunterConfig, cluster: ClusterView, demands: list[CoreDemand]) -> None:
    """Refuse CPU engines that cannot all start on the node (Ray would leave one pending forever); warn
    where only scaling out or a rollout would need more cores than it has. Not checked against a declared
    `cluster:`: there each CPU replica gets a node (a KubeRay pod) of its own, added as it scales."""
    if cfg.cluster is not None:
        return
    problem = core_shortfall(demands, cluster.largest_node_cpus, cluster.cpu_node)
    if problem and any(cfg.find_model(d.model).accelerator == "auto" for d in demands):  # type: ignore[union-attr]
        problem += ("\n(accelerator: auto runs these models on CPU: no GPU is visible here. A config for a GPU "
                    "cluster says so with `accelerator: gpu` or a `cluster:` section.)")
    if problem and cluster.cpus_fixed:
        raise ConfigError(problem)
    if problem:  # several nodes: the replicas may spread, or wait for the autoscaler
        log.warning("%s\n(the Ray cluster has several nodes: replicas that fit none wait for the autoscaler)",
                    problem)
        return
    headroom = core_headroom(demands, cluster.largest_node_cpus, cluster.cpu_node)
    if headroom:
        log.warning("%s", headroom)


def cpu_core_demands(cfg: ShunterConfig, plans: dict[str, dict[str, dict[str, Any]]]) -> list[CoreDemand]:
    """What each CPU model of `plans` (plan_deployments) asks of the node's cores."""
    return [_core_demand(model, plans[model.name]) for model in cfg.models
            if next(iter(plans[model.name].values()))["accelerator"] == "cpu"]


def _core_demand(model: ModelConfig, versions: dict[str, dict[str, Any]]) -> CoreDemand:
    """What `model`'s CPU replicas ask of the node: as many as its deployments start with (Ray's
    num_replicas or initial_replicas, live versions only), and at most (max_replicas, two versions)."""
    cores = next(iter(versions.values()))["cpu_cores"]
    start = sum(p["deployment"].get("num_replicas") or p["deployment"]["autoscaling_config"]["initial_replicas"]
                for p in versions.values())
    if model.autoscaling is None:
        counted = "replicas"
    elif model.autoscaling.min_replicas == 0 and not model.standby_replicas:
        counted = "autoscaling starts 1 even at min_replicas 0"
    else:
        counted = "autoscaling.min_replicas"
    most = "autoscaling.max_replicas" if model.autoscaling else "replicas"
    if model.standby_replicas:
        counted += " + standby_replicas"
        most += " + standby_replicas"
    if model.versioned:
        live = [v for v, weight in model.file_weights() if weight > 0]
        counted += f", version{'s' if len(live) > 1 else ''} {', '.join(live)}"
        most += f", {model.most_running_versions} versions at once in a rollout"
    return CoreDemand(model.name, cores, start, model.most_replicas * model.most_running_versions,
                      str(model.cpu_cores_per_replica), counted, most, model.most_running_versions > 1)


def _plan_version(model: ModelConfig, version: str, name: str, accel: str, cores: int | None,
                  spare_cores: int) -> dict[str, Any]:
    served = model.for_version(version)
    tp, pp = served.engine.tensor_parallel_size, served.engine.pipeline_parallel_size
    surge = model.draining.surge_percent
    if accel == "cpu":
        assert cores is not None
        if surge == "auto":
            surge = 100 if cores * model.most_replicas <= spare_cores else 0
        if 0 < cores < tp * pp:
            raise ConfigError(f"models[{model.name}].cpu_cores_per_replica: {cores} cores cannot host "
                              f"{tp * pp} engine ranks (tensor_parallel_size {tp} x pipeline_parallel_size "
                              f"{pp}); give at least one core per rank")
        placement: dict[str, Any] = {"ray_actor_options": {"num_cpus": cores}}
        if served.engine.process_start in ("auto", "fork-server"):
            # The replica's own process is forked from the node's server too, vLLM already imported in it.
            placement["ray_actor_options"]["runtime_env"] = {"py_executable": worker_fork.EXECUTABLE}
    else:
        placement = layout_of(served).serve_placement()
    return {
        "deployment": {
            "name": name,
            **(version_replica_count(model, version) if model.versioned else replica_count(model)),
            "max_surge_percent": 100 if surge == "auto" else surge,
            **placement,
        },
        "accelerator": accel,
        "cpu_cores": cores,
        "version": version,
    }


def check_placement(cfg: ShunterConfig, cluster: ClusterView,
                    accelerators: dict[str, str] | None = None) -> ClusterPlan | None:
    """Every version's split checked against its model (heads, layers) and engine (dtype, quantization,
    GPU type), then every GPU replica placed on the cluster's nodes: the config's `cluster:` if it has
    one (a misfit is an error), else the live GPU nodes (a misfit is a warning: an autoscaler may add
    nodes). Raises ConfigError listing every problem; returns the GPU plan (None when there are no GPU
    models, no nodes to check against, or the live nodes are too few now)."""
    accelerators = accelerators or {m.name: _accelerator(m, cluster) for m in cfg.models}
    problems: list[str] = []
    for model in cfg.models:
        for version in model.version_names():
            served = model.for_version(version)
            where = f"models[{model.name}]" + (f".versions[{version}]" if model.versioned else "")
            problems += engine_problems(where, served.engine, accelerators[model.name], model.accelerator_type)
            shape = model_shape(served.source or "", cfg.model_cache_dir)
            if shape is not None:
                problems += parallel_problems(where, shape, served.engine.tensor_parallel_size,
                                              served.engine.pipeline_parallel_size)
            elif served.engine.tensor_parallel_size * served.engine.pipeline_parallel_size > 1:
                log.warning("%s: no config.json of %s found offline; the engine checks its split at start",
                            where, served.source)
    demands = replica_demands(cfg, accelerators)
    if problems:
        raise ConfigError("this config cannot be served:\n  " + "\n  ".join(problems))
    nodes = cluster_nodes(cfg, cluster)
    if not demands:
        return None
    if not nodes:
        log.warning("GPU models are configured but no GPU node is visible and the config has no `cluster:`; "
                    "placement is not checked now (replicas wait for the autoscaler to add nodes)")
        return None
    try:
        return plan_cluster(demands, nodes)
    except PlacementError as exc:
        if cfg.cluster is None:
            # The live cluster may be autoscaled (KubeRay adds nodes for pending demands): its nodes now
            # are not its limit. Say so loudly; `cluster:` in the config makes this an error.
            log.warning("this config does not fit the GPU nodes the cluster has now; replicas that do not "
                        "fit wait for the autoscaler to add nodes:\n  %s", str(exc).replace("\n", "\n  "))
            return None
        raise ConfigError("this config does not fit the declared cluster (cluster.node_groups):\n  "
                          + str(exc).replace("\n", "\n  ")) from None


def cluster_nodes(cfg: ShunterConfig, cluster: ClusterView) -> list[NodeSpec]:
    """The nodes placement is planned on: the config's description, else the live GPU nodes."""
    return declared_nodes(cfg.cluster) if cfg.cluster else list(cluster.gpu_nodes)


def replica_count(model: ModelConfig) -> dict[str, Any]:
    """A fixed `num_replicas`, or Ray's autoscaling_config driven by Shunter's queue-depth policy (which
    applies its own delays, so Ray's are zero)."""
    scaling = model.autoscaling
    standby = model.standby_replicas
    if scaling is None and not standby:
        return {"num_replicas": model.replicas}
    # With standby replicas a fixed count is scaled by the policy too: it names which replicas serve.
    least, most = (scaling.min_replicas, scaling.max_replicas) if scaling else (model.replicas, model.replicas)
    return {"autoscaling_config": _autoscaling_config(
        least + standby, most + standby, max(1, least + standby), _policy_kwargs(model))}


def version_replica_count(model: ModelConfig, version: str) -> dict[str, Any]:
    """One version of a versioned model. Whether it runs at all is live state (a rollout starts the new
    version and retires the old one), so every version is scaled by Shunter's policy, which reads that
    state: a retired version gets 0 replicas, a live one what the model asks for (a fixed count, or the
    queue-depth range). Ray's own bounds are [0, most]; the model's bounds are the policy's."""
    weights = dict(model.file_weights())
    live_at_start = weights.get(version, 0) > 0
    kwargs = _policy_kwargs(model)
    if model.autoscaling is None:  # a fixed count: the policy holds it while the version is live
        kwargs.update(min_replicas=model.replicas, max_replicas=model.replicas)
    first = max(1, kwargs["min_replicas"] + model.standby_replicas) if live_at_start else 0
    kwargs["versioning"] = {"model": model.name, "version": version, "fingerprint": model.fingerprint,
                            "live_at_start": live_at_start}
    return {"autoscaling_config": _autoscaling_config(0, model.most_replicas, first, kwargs)}


def _policy_kwargs(model: ModelConfig) -> dict[str, Any]:
    scaling = model.autoscaling
    standby = {"standby_replicas": model.standby_replicas} if model.standby_replicas else {}
    if scaling is None:  # fixed count; the delays never matter since min == max
        return {"model": model.name, "min_replicas": model.replicas, "max_replicas": model.replicas,
                "target_per_replica": 1.0, "upscale_delay_s": 0.0, "downscale_delay_s": 0.0, **standby}
    return {"model": model.name, "min_replicas": scaling.min_replicas, "max_replicas": scaling.max_replicas,
            "target_per_replica": scaling.target_queue_per_replica, "upscale_delay_s": scaling.upscale_delay_s,
            "downscale_delay_s": scaling.downscale_delay_s, "batch_max_replicas": scaling.batch_replicas,
            **standby}


def _autoscaling_config(least: int, most: int, initial: int, policy_kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        "min_replicas": least,
        "max_replicas": most,
        "initial_replicas": initial,
        "upscale_delay_s": 0,
        "downscale_delay_s": 0,
        "downscale_to_zero_delay_s": 0,
        # Ray averages the replicas' reports over this window; the policy has its own delays, so a
        # short window only makes it see a burst sooner (Ray's default is 30 s).
        "look_back_period_s": 15,
        # The builder names the policy (shunter.deployments.app); its arguments are the plan's.
        "policy": {"policy_kwargs": policy_kwargs},
    }


def _cpu_cores(model: ModelConfig, cluster: ClusterView, cpu_replicas: int) -> int:
    """Cores each CPU replica of `model` owns: as configured, auto = the node split evenly, shared = none
    (0: the engine runs on all of the node's cores, beside the others)."""
    cores = model.cpu_cores_per_replica
    if cores == "shared":
        return 0
    if cores == "auto":  # at least a core per rank of the widest version
        engines = [model.for_version(v).engine for v in model.version_names()]
        ranks = max(e.tensor_parallel_size * e.pipeline_parallel_size for e in engines)
        return max(ranks, cores_per_replica(cluster.largest_node_cpus, cpu_replicas))
    return cores


def _accelerator(model: ModelConfig, cluster: ClusterView) -> str:
    if model.accelerator != "auto":
        return model.accelerator
    return "gpu" if cluster.has_gpus else "cpu"
