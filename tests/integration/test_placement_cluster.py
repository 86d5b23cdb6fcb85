"""Placement on a simulated multi-node GPU cluster: several raylets on this machine (ray.cluster_utils),
each advertising fake GPUs, and the real app builder, gateway and ModelServer on top.

No GPU exists here, so the replicas run the FAKE engine (tests/integration/fault_engine.py) in place of
vLLM; what is real is everything this test is about: Ray Serve creating the replicas, the replica
reserving its engine's placement group stage by stage, and where Ray puts each bundle.

The cluster has nodes of 3, 2 and 2 GPUs. The 3-GPU node is the trap: Ray's PACK, given four one-GPU
bundles (what vLLM and Ray Serve LLM ask for), fills it with three and splits a TP=2 stage across nodes
(`shunter bench placement` measures how often that happens on fragmented clusters).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from shunter.local_serve import free_port
from tests.e2e.live import wait_ready
from tests.integration.local_app import FACTORY, ROOT

pytestmark = pytest.mark.own_cluster

GPUS_PER_NODE = (3, 2, 2)
APP = "placement"


def _args() -> dict:
    fake = {"accelerator": "gpu", "engine": {"max_model_len": 512}}
    return {"models": [
        {"name": "staged", "source": "fake:flaky", **fake,
         "engine": {"max_model_len": 512, "tensor_parallel_size": 2, "pipeline_parallel_size": 2}},
        {"name": "wide", "source": "fake:flaky", **fake,
         "engine": {"max_model_len": 512, "tensor_parallel_size": 2}},
    ]}


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict]:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from shunter.config import parse_config
    from shunter.deployments.app import assemble

    sim = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    gpu_nodes = [sim.add_node(num_cpus=1, num_gpus=gpus) for gpus in GPUS_PER_NODE]
    sim.wait_for_nodes()
    ray.init(address=sim.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(assemble(parse_config(_args()), engine_factory=FACTORY), name=APP, route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, timeout_s=180)
        gpus_of = {node.node_id: gpus for node, gpus in zip(gpu_nodes, GPUS_PER_NODE, strict=True)}
        yield {"base": base, "gpus_of": gpus_of}
    finally:
        serve.shutdown()
        ray.shutdown()
        sim.shutdown()


def _groups() -> dict[str, dict]:
    from ray.util import placement_group_table

    return {g["name"]: g for g in placement_group_table().values() if g["state"] == "CREATED"}


def test_each_pipeline_stage_lands_on_one_node_and_the_stages_on_different_nodes(cluster):
    engine = [g for name, g in _groups().items() if name.startswith("staged/") and name.endswith("-engine")]
    assert len(engine) == 1, f"one engine group for the one TP=2 x PP=2 replica: {sorted(_groups())}"
    bundles = engine[0]["bundles_to_node_id"]
    assert len(bundles) == 4 and all(b == {"GPU": 1.0} for b in engine[0]["bundles"].values())
    stage_nodes = [{bundles[0], bundles[1]}, {bundles[2], bundles[3]}]
    assert all(len(nodes) == 1 for nodes in stage_nodes), f"a stage split across nodes: {stage_nodes}"
    assert stage_nodes[0] != stage_nodes[1], "the two stages share no node (no node has 4 GPUs)"
    assert not [name for name in _groups() if name.endswith("-stages")], "step one's group was released"


def test_a_one_stage_replica_is_one_strict_pack_group_beside_its_actor(cluster):
    from ray.util.state import list_actors

    wide = [g for g in _groups().values() if g["strategy"] == "STRICT_PACK"]
    assert len(wide) == 1, "Serve made the TP=2 replica's group"
    nodes = set(wide[0]["bundles_to_node_id"].values())
    assert len(nodes) == 1
    replicas = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "model-wide" in a["class_name"]]
    assert replicas and replicas[0]["node_id"] in nodes, "the replica actor sits beside rank 0"


def test_the_cluster_is_used_as_the_planner_planned_it(cluster):
    """Three TP=2 units (two stages and one replica) on nodes of 3, 2 and 2 GPUs: one unit per node, the
    3-GPU node keeps a spare GPU. The pure planner, given the same nodes, makes the same split."""
    import ray

    from shunter.config import parse_config
    from shunter.placement import NodeSpec
    from shunter.serve_plan import ClusterView, check_placement

    used = {node: 0 for node in cluster["gpus_of"]}
    for group in _groups().values():
        for node in group["bundles_to_node_id"].values():
            if node in used:
                used[node] += 1
    assert sorted(used.values()) == [2, 2, 2], used
    assert ray.available_resources().get("GPU") == 1
    nodes = tuple(NodeSpec(node, gpus) for node, gpus in cluster["gpus_of"].items())
    plan = check_placement(parse_config(_args()), ClusterView(True, 2, nodes))
    planned = {n: gpus - plan.free_gpus[n] for n, gpus in cluster["gpus_of"].items()}
    assert sorted(planned.values()) == [2, 2, 2]
    assert all(len(set(r.stage_nodes)) == len(r.stage_nodes) for r in plan.replicas)


def test_the_models_answer_through_the_gateway(cluster):
    for model in ("staged", "wide"):
        resp = httpx.post(f"{cluster['base']}/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "ping pong"}]})
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == model
