"""Where an engine replica's devices go: a pure planner, tested without a cluster.

A replica of a model with tensor parallelism TP and pipeline parallelism PP owns TP x PP devices. The
rule the planner keeps: the TP ranks of one pipeline stage are on one node (they all-reduce every layer
and need the node's fast interconnect); stages exchange one activation per step and may sit on
different nodes.

Ray's placement-group strategies cannot say that for PP > 1 ("groups of TP bundles, each group on one
node"): STRICT_PACK forbids spanning nodes, and PACK (what vLLM and Ray Serve LLM use) fills nodes
greedily bundle by bundle, so on a node with free GPUs that are not a multiple of TP it splits a stage
across nodes. The runtime therefore reserves in two steps (deployments/replica/placement.py): one bundle
of TP devices per stage, which Ray must place on a single node, then per-device bundles pinned to the
nodes the stages got. A PP = 1 replica needs no such step: its devices are one STRICT_PACK group.

This module decides the shape of those requests and checks a whole config against a description of the
nodes (first-fit, stage by stage, best-fitting node first), so impossible requests fail before
anything starts and `shunter plan` shows where each stage would land.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shunter.config import ClusterConfig, ModelConfig, ShunterConfig

# A bundle's share of a node's `accelerator_type:<T>` resource (Ray gives each node 1 of its type): any
# positive amount pins the bundle to nodes of that type without limiting how many bundles fit.
ACCELERATOR_TYPE_SHARE = 0.001
NODE_ID_LABEL = "ray.io/node-id"


class PlacementError(ValueError):
    """A config whose replicas cannot be placed on the described nodes; one line per problem."""


@dataclass(frozen=True)
class NodeSpec:
    """One node as the planner sees it: its name, its GPUs and their type."""

    name: str
    gpus: int
    cpus: int = 0
    accelerator_type: str | None = None


# A type starts with a letter, so "2x8x" is an error rather than one 2-GPU node of type "8x".
_NODES_PATTERN = re.compile(r"^(?:(?P<count>[1-9]\d*)x)?(?P<gpus>\d+)(?:x(?P<type>[A-Za-z][A-Za-z0-9_.-]*))?$")


def parse_nodes(specs: Iterable[str]) -> list[NodeSpec]:
    """`COUNTxGPUS[xTYPE]` per item, e.g. `2x8xH100` = two nodes of 8 H100s, `4` = one 4-GPU node."""
    nodes: list[NodeSpec] = []
    for spec in specs:
        match = _NODES_PATTERN.match(spec.strip())
        if not match:
            raise ValueError(f"node spec {spec!r}: expected COUNTxGPUS[xTYPE], e.g. 2x8xH100 or 4")
        for _ in range(int(match["count"] or 1)):
            nodes.append(NodeSpec(f"node-{len(nodes)}", int(match["gpus"]), accelerator_type=match["type"]))
    return nodes


@dataclass(frozen=True)
class EngineLayout:
    """The devices of one engine replica: TP ranks per stage, PP stages, their accelerator type."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    accelerator_type: str | None = None

    @property
    def devices(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    def device_bundle(self, extra: dict[str, float] | None = None) -> dict[str, float]:
        bundle = {"GPU": 1.0, **(extra or {})}
        if self.accelerator_type:
            bundle[f"accelerator_type:{self.accelerator_type}"] = ACCELERATOR_TYPE_SHARE
        return bundle

    def serve_placement(self) -> dict[str, Any]:
        """Ray Serve deployment options of a GPU replica. One device: the actor holds it. One stage:
        the actor and its devices in one STRICT_PACK group (all on one node, the actor beside rank 0).
        Several stages: the actor holds one CPU and reserves the stages itself (stage_bundles)."""
        if self.pipeline_parallel > 1:
            options: dict[str, Any] = {"ray_actor_options": {"num_cpus": 1}}
            if self.accelerator_type:  # the engine's driver process runs beside the GPUs, not on the head
                options["ray_actor_options"]["resources"] = {
                    f"accelerator_type:{self.accelerator_type}": ACCELERATOR_TYPE_SHARE}
            return options
        if self.devices == 1:
            actor: dict[str, Any] = {"num_cpus": 1, "num_gpus": 1}
            if self.accelerator_type:
                actor["resources"] = {f"accelerator_type:{self.accelerator_type}": ACCELERATOR_TYPE_SHARE}
            return {"ray_actor_options": actor}
        return {
            "ray_actor_options": {"num_cpus": 1},
            "placement_group_bundles": [self.device_bundle({"CPU": 1.0})]
            + [self.device_bundle() for _ in range(self.devices - 1)],
            "placement_group_strategy": "STRICT_PACK",
        }

    def stage_bundles(self) -> list[dict[str, float]]:
        """Step one of a multi-stage reservation: one bundle of TP devices per stage. A bundle is never
        split across nodes, so each stage gets one node; PACK puts stages together where they fit."""
        bundle = {"GPU": float(self.tensor_parallel)}
        if self.accelerator_type:
            bundle[f"accelerator_type:{self.accelerator_type}"] = ACCELERATOR_TYPE_SHARE
        return [dict(bundle) for _ in range(self.pipeline_parallel)]

    def engine_bundles(self, stage_nodes: list[str]) -> tuple[list[dict[str, float]], list[dict[str, str]]]:
        """Step two: one bundle per device, in rank order, each pinned (by node-id label) to the node its
        stage got. vLLM's Ray executor takes one worker per bundle and refuses bundles of several GPUs."""
        if len(stage_nodes) != self.pipeline_parallel:
            raise ValueError(f"{len(stage_nodes)} stage nodes for {self.pipeline_parallel} stages")
        bundles = [self.device_bundle() for _ in range(self.devices)]
        selectors = [{NODE_ID_LABEL: stage_nodes[rank // self.tensor_parallel]} for rank in range(self.devices)]
        return bundles, selectors


@dataclass(frozen=True)
class ReplicaDemand:
    """`count` replicas of one model version, each needing `layout`."""

    model: str
    version: str
    layout: EngineLayout
    count: int


@dataclass
class ReplicaPlacement:
    model: str
    version: str
    replica: int
    stage_nodes: list[str]  # node name per pipeline stage


@dataclass
class ClusterPlan:
    replicas: list[ReplicaPlacement] = field(default_factory=list)
    free_gpus: dict[str, int] = field(default_factory=dict)

    def stages_of(self, model: str) -> list[list[str]]:
        return [r.stage_nodes for r in self.replicas if r.model == model]


def layout_of(model: ModelConfig) -> EngineLayout:
    """The devices one replica of `model` (as one version serves it) needs."""
    return EngineLayout(model.engine.tensor_parallel_size, model.engine.pipeline_parallel_size,
                        model.accelerator_type)


def replica_demands(cfg: ShunterConfig, accelerators: dict[str, str], least: bool = False) -> list[ReplicaDemand]:
    """What the GPU models of `cfg` ask of the cluster: for each, the versions that may run at once (a
    rollout runs two), the largest first, at the most replicas (or, `least`, the fewest it keeps)."""
    demands = []
    for model in cfg.models:
        if accelerators[model.name] != "gpu":
            continue
        layouts = sorted(((v, layout_of(model.for_version(v))) for v in model.version_names()),
                         key=lambda item: -item[1].devices)
        count = model.most_replicas if not least else model.fewest_replicas
        running = model.most_running_versions if not least else 1
        demands += [ReplicaDemand(model.name, v, layout, count) for v, layout in layouts[:running] if count]
    return demands


def declared_nodes(cluster: ClusterConfig) -> list[NodeSpec]:
    """A config's `cluster.node_groups` as nodes, named <group>-<index>."""
    return [NodeSpec(f"{group.name}-{i}", group.gpus_per_node, group.cpus_per_node, group.accelerator_type)
            for group in cluster.node_groups for i in range(group.count)]


def check_layout(where: str, layout: EngineLayout, nodes: list[NodeSpec]) -> list[str]:
    """Problems with one replica's layout on these nodes, whatever else runs there."""
    candidates = [n for n in nodes if _type_matches(n, layout)]
    if not candidates:
        have = sorted({n.accelerator_type or "untyped" for n in nodes})
        return [f"{where}: no node has accelerator_type {layout.accelerator_type!r} (nodes have: "
                f"{', '.join(have)})"]
    largest = max(n.gpus for n in candidates)
    problems = []
    if layout.tensor_parallel > largest:
        problems.append(
            f"{where}: tensor_parallel_size {layout.tensor_parallel} exceeds the {largest} GPUs of the largest "
            f"node; tensor-parallel ranks must share one node (use pipeline_parallel_size to span nodes)")
    total = sum(n.gpus for n in candidates)
    if layout.devices > total:
        problems.append(f"{where}: one replica needs {layout.devices} GPUs (TP {layout.tensor_parallel} x PP "
                        f"{layout.pipeline_parallel}); the cluster has {total}")
    return problems


def plan_cluster(demands: list[ReplicaDemand], nodes: list[NodeSpec]) -> ClusterPlan:
    """Place every replica's stages on `nodes`, or raise PlacementError naming what does not fit.

    Largest stages first (they are the hardest to fit); each stage goes to the node of the right type
    with the fewest free GPUs that still holds it, so small replicas fill fragments and whole nodes stay
    free for large stages."""
    problems: list[str] = []
    for d in demands:
        problems += check_layout(f"models[{d.model}] version {d.version}" if d.version != "default"
                                 else f"models[{d.model}]", d.layout, nodes)
    if problems:
        raise PlacementError("\n".join(problems))
    free = {n.name: n.gpus for n in nodes}
    by_name = {n.name: n for n in nodes}
    plan = ClusterPlan()
    used: dict[str, int] = {}
    for d in sorted(demands, key=lambda d: (-d.layout.tensor_parallel, -d.layout.devices)):
        for replica in range(d.count):
            stage_nodes: list[str] = []
            for stage in range(d.layout.pipeline_parallel):
                fits = [name for name, gpus in free.items()
                        if gpus >= d.layout.tensor_parallel and _type_matches(by_name[name], d.layout)]
                if not fits:
                    need = d.count * d.layout.devices
                    raise PlacementError(
                        f"models[{d.model}]: replica {replica + 1} of {d.count}, stage {stage + 1} of "
                        f"{d.layout.pipeline_parallel} needs {d.layout.tensor_parallel} free GPUs on one node "
                        f"and none has them (free GPUs per node: {_free_text(free)}); its {d.count} replicas "
                        f"need {need} GPUs in all; placed before it: {_free_text(used) or 'nothing'}. Lower "
                        "replicas, or add nodes.")
                best = min(fits, key=lambda name: (free[name], list(free).index(name)))
                free[best] -= d.layout.tensor_parallel
                used[d.model] = used.get(d.model, 0) + d.layout.tensor_parallel
                stage_nodes.append(best)
            plan.replicas.append(ReplicaPlacement(d.model, d.version, replica, stage_nodes))
    plan.free_gpus = free
    return plan


def _type_matches(node: NodeSpec, layout: EngineLayout) -> bool:
    return layout.accelerator_type is None or node.accelerator_type == layout.accelerator_type


def _free_text(free: dict[str, int]) -> str:
    return ", ".join(f"{name}={gpus}" for name, gpus in free.items())
