"""The devices of one GPU engine replica, as Ray placement groups (the plan's shape: shunter.placement).

- One stage (PP = 1): Ray Serve already created the replica's STRICT_PACK group (the actor and its TP
  devices on one node); the engine is handed that group.
- Several stages: the replica reserves its own group, in two steps, because no single Ray strategy keeps
  each stage's TP ranks on one node while letting stages span nodes:
  1. one bundle of TP GPUs per stage (PACK). Ray never splits a bundle, so each stage gets one node; the
     autoscaler sees TP-GPU demands and adds nodes that can hold a stage.
  2. that group is released and one bundle per GPU is reserved, each pinned by the `ray.io/node-id` label
     to its stage's node. If something else takes those GPUs in between, step 2 does not become ready;
     it is dropped and both steps run again.
  The group belongs to the replica actor: Ray removes it when the replica dies, and `release` removes it
  when the replica stops.

vLLM's Ray executor runs one worker per GPU bundle of the group it is given (the engine core runs in a
subprocess, outside the actor's placement-group context, so the group is passed to it explicitly).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from shunter.placement import EngineLayout

log = logging.getLogger("ray.serve")

STAGE_WAIT_S = 900.0  # how long step 1 may wait for capacity (the autoscaler adding a node)
PIN_WAIT_S = 60.0  # how long step 2 may wait for GPUs step 1 just found free
ATTEMPTS = 5


class PlacementTimeout(RuntimeError):
    """The replica's devices could not be reserved; the message says what was asked and what is free."""


@dataclass
class EngineGroup:
    """The placement group the engine runs in, and which node holds each pipeline stage."""

    placement_group: Any
    stage_nodes: list[str]
    owned: bool  # reserved by the replica (released by it), or Serve's own group

    def describe(self) -> dict[str, Any]:
        return {"stage_nodes": self.stage_nodes, "bundles": len(self.placement_group.bundle_specs)}

    def release(self) -> None:
        if self.owned:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)


async def engine_group(layout: EngineLayout, name: str) -> EngineGroup | None:
    """The group a GPU engine of `layout` runs in (None for one device: the actor holds its GPU)."""
    if layout.devices == 1:
        return None
    if layout.pipeline_parallel == 1:
        from ray.util.placement_group import get_current_placement_group, placement_group_table

        group = get_current_placement_group()
        if group is None:
            raise RuntimeError(f"{name}: a {layout.devices}-GPU replica must run in its deployment's placement "
                               "group; deploy it through shunter.deployments.app:build_app")
        await asyncio.wrap_future(group.ready().future())
        node = placement_group_table(group)["bundles_to_node_id"][0]
        return EngineGroup(group, [node], owned=False)
    return await reserve_stages(layout, name)


async def reserve_stages(layout: EngineLayout, name: str, stage_wait_s: float = STAGE_WAIT_S,
                         pin_wait_s: float = PIN_WAIT_S, attempts: int = ATTEMPTS) -> EngineGroup:
    """Steps 1 and 2 above; raises PlacementTimeout when capacity never comes."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    for attempt in range(1, attempts + 1):
        stages = placement_group(layout.stage_bundles(), strategy="PACK", name=f"{name}-stages")
        if not await _ready(stages, stage_wait_s, f"{name}: {layout.pipeline_parallel} stages of "
                            f"{layout.tensor_parallel} GPUs"):
            remove_placement_group(stages)
            raise PlacementTimeout(
                f"{name}: no capacity for {layout.pipeline_parallel} pipeline stages of {layout.tensor_parallel} "
                f"GPU(s) on one node each after {stage_wait_s:.0f}s; free GPUs in the cluster: {_free_gpus()}")
        table = placement_group_table(stages)["bundles_to_node_id"]
        stage_nodes = [table[i] for i in range(layout.pipeline_parallel)]
        remove_placement_group(stages)
        bundles, selectors = layout.engine_bundles(stage_nodes)
        group = placement_group(bundles, strategy="PACK", name=f"{name}-engine", bundle_label_selector=selectors)
        if await _ready(group, pin_wait_s, f"{name}: pinning {layout.devices} GPUs to the stages' nodes"):
            log.info("%s: pipeline stages on nodes %s (%d GPU(s) each)", name,
                     [n[:12] for n in stage_nodes], layout.tensor_parallel)
            return EngineGroup(group, stage_nodes, owned=True)
        remove_placement_group(group)
        log.warning("%s: the GPUs of the stages' nodes were taken before they could be pinned (attempt %d of "
                    "%d); reserving again", name, attempt, attempts)
    raise PlacementTimeout(f"{name}: could not pin {layout.devices} GPUs to stage nodes in {attempts} attempts")


async def _ready(group: Any, timeout_s: float, what: str) -> bool:
    """Wait for a group, logging every 30 s so a replica waiting for capacity says why."""
    future = asyncio.wrap_future(group.ready().future())
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            future.cancel()
            return False
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout=min(30.0, left))
            return True
        except TimeoutError:
            if time.monotonic() < deadline:
                log.info("%s: still waiting for capacity (free GPUs in the cluster: %s)", what, _free_gpus())


def _free_gpus() -> str:
    import ray

    return f"{ray.available_resources().get('GPU', 0):g}"
