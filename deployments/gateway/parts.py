"""The parts of one gateway replica that its routes delegate to, and how a route finds them.

The routes (`openai_routes`, `admin_routes`) are plain FastAPI functions, vLLM-style, not methods of the
deployment class; each asks for the replica's parts with `Depends(parts)`, which reads them from the
Serve replica it runs in (`serve.get_replica_context().servable_object`, Ray Serve's public handle on the
deployment instance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends
from ray import serve

from shunter.config import ShunterConfig
from shunter.deployments.gateway.access import AccessControl
from shunter.deployments.gateway.forward import Forwarder
from shunter.deployments.gateway.lora import LiveAdapters
from shunter.deployments.gateway.replica_admin import ReplicaAdmin
from shunter.deployments.gateway.request_body import BodyReader
from shunter.deployments.gateway.serving_state import ServingState
from shunter.deployments.gateway.tiering import Tiering
from shunter.deployments.gateway.traffic import LiveVersions
from shunter.deployments.gateway.usage import UsageWriter


@dataclass
class GatewayParts:
    config: ShunterConfig
    access: AccessControl  # keys, allow-lists, limits, quotas
    body: BodyReader
    state: ServingState  # per model and version: routing states, admission gates, drain trackers
    traffic: LiveVersions  # the live weights and rollouts, from the control actor
    replicas: ReplicaAdmin  # an operator's replica drains
    forwarder: Forwarder
    tiering: Tiering | None
    adapters: LiveAdapters  # the LoRA adapters served now: the config's, with the admin API's changes
    servers: dict[str, dict[str, Any]]  # model -> version -> ModelServer deployment handle
    created: int  # when this gateway started (the model cards' `created`)
    usage: UsageWriter | None = None  # the usage ledger's writer; None: usage.enabled is false
    batch: Any = None  # the BatchService deployment's handle (files); None: batch.enabled is false


async def parts() -> GatewayParts:
    """The FastAPI dependency: this replica's parts."""
    return serve.get_replica_context().servable_object.parts


Parts = Annotated[GatewayParts, Depends(parts)]  # a route's parameter: `gw: Parts`
