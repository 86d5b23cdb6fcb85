"""`cluster:`: the GPU nodes an app is planned for (`shunter plan`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from shunter.config.base import StrictModel


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
