"""The placement planner beyond test_placement_plan.py: what `shunter plan` prints for the multi-model config,
Serve options per layout, best fit, accelerator types, config-level refusals, node specs, versioned demands."""

from __future__ import annotations

from pathlib import Path

import pytest

from shunter.cli import main as shunter
from shunter.config import ConfigError, parse_config
from shunter.placement import (
    NODE_ID_LABEL,
    EngineLayout,
    NodeSpec,
    PlacementError,
    ReplicaDemand,
    parse_nodes,
    plan_cluster,
    replica_demands,
)
from shunter.serve_plan import ClusterView, check_placement, cluster_nodes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NO_LIVE_GPUS = ClusterView(has_gpus=False, largest_node_cpus=2)
H100 = "accelerator_type:H100"


def _gpu_model(name: str, tp: int = 1, pp: int = 1, **extra) -> dict:
    """A GPU model whose shape no table knows (org/...), so only placement is checked."""
    return {"name": name, "source": f"org/{name}", "accelerator": "gpu",
            "engine": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}, **extra}


def _cluster(*groups: tuple[str, int, int, str | None]) -> dict:
    return {"node_groups": [{"name": n, "count": c, "gpus_per_node": g, "accelerator_type": t}
                            for n, c, g, t in groups]}


def test_shunter_plan_prints_where_every_replica_of_the_multi_model_config_lands(capsys):
    assert shunter(["plan", str(CONFIGS / "gpu-multi-model.yaml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    replicas = [line.strip() for line in lines if line.startswith("  replica")]
    assert replicas == ["replica 1: stage 1 -> gpu-h100-0, stage 2 -> gpu-h100-1",  # 405B, TP 8 x PP 2
                        "replica 1: stage 1 -> gpu-h100-2", "replica 2: stage 1 -> gpu-h100-2",  # 70B, TP 4
                        *[f"replica {i}: stage 1 -> gpu-h100-3" for i in range(1, 5)]]  # 8B, 1 GPU
    assert "all-minilm-l6-v2: CPU, 4 core(s) per replica" in lines
    assert lines[-1] == "free GPUs after placement: gpu-h100-0=0, gpu-h100-1=0, gpu-h100-2=0, gpu-h100-3=4"


def test_shunter_plan_on_nodes_from_the_command_line_names_them_by_kind(capsys):
    argv = ["plan", str(CONFIGS / "gpu-llama-405b-tp8-pp2.yaml"), "--nodes", "2x8xH100", "--nodes", "4"]
    assert shunter(argv) == 0
    out = capsys.readouterr().out
    assert "on 3 node(s): h100x8-0 (8 H100), h100x8-1 (8 H100), gpux4-0 (4 GPU)" in out
    assert "stage 1 -> h100x8-0, stage 2 -> h100x8-1" in out


def test_shunter_plan_refuses_a_malformed_node_spec():
    with pytest.raises(SystemExit, match="expected COUNTxGPUS"):
        shunter(["plan", str(CONFIGS / "gpu-llama-8b.yaml"), "--nodes", "8 H100s"])


@pytest.mark.parametrize("layout,options", [
    (EngineLayout(), {"ray_actor_options": {"num_cpus": 1, "num_gpus": 1}}),
    (EngineLayout(1, 1, "L4"), {"ray_actor_options": {"num_cpus": 1, "num_gpus": 1,
                                                      "resources": {"accelerator_type:L4": 0.001}}}),
    (EngineLayout(2), {"ray_actor_options": {"num_cpus": 1}, "placement_group_strategy": "STRICT_PACK",
                       "placement_group_bundles": [{"GPU": 1.0, "CPU": 1.0}, {"GPU": 1.0}]}),
    (EngineLayout(2, 2), {"ray_actor_options": {"num_cpus": 1}}),
    (EngineLayout(2, 2, "H100"), {"ray_actor_options": {"num_cpus": 1, "resources": {H100: 0.001}}}),
])
def test_serve_options_follow_the_layout(layout, options):
    """One device: the actor holds it. One stage: a STRICT_PACK group, the actor in bundle 0. Several
    stages: the actor reserves them itself, beside GPUs of its type."""
    assert layout.serve_placement() == options


def test_every_rank_is_pinned_to_its_stages_node_in_rank_order():
    layout = EngineLayout(4, 3)
    assert layout.stage_bundles() == [{"GPU": 4.0}] * 3
    bundles, selectors = layout.engine_bundles(["x", "y", "z"])
    assert bundles == [{"GPU": 1.0}] * 12
    assert [s[NODE_ID_LABEL] for s in selectors] == ["x"] * 4 + ["y"] * 4 + ["z"] * 4
    assert EngineLayout(2).engine_bundles(["only"])[1] == [{NODE_ID_LABEL: "only"}] * 2


def test_a_stage_goes_whole_to_one_node_or_not_at_all():
    two_stages = [ReplicaDemand("m", "default", EngineLayout(2, 2), 1)]
    plan = plan_cluster(two_stages, [NodeSpec("three", 3), NodeSpec("two", 2)])
    assert plan.replicas[0].stage_nodes == ["two", "three"]
    assert plan.free_gpus == {"three": 1, "two": 0}
    # Four GPUs are free after the first stage, but in pieces of one: the second stage is not split.
    with pytest.raises(PlacementError, match=r"stage 2 of 2 needs 2 free GPUs on one node"):
        plan_cluster(two_stages, [NodeSpec("three", 3)] + [NodeSpec(f"one-{i}", 1) for i in range(3)])


def test_best_fit_sends_single_gpu_replicas_to_the_small_node_whatever_the_config_order():
    demands = [ReplicaDemand("small", "default", EngineLayout(1), 4),
               ReplicaDemand("big", "default", EngineLayout(8), 2)]
    plan = plan_cluster(demands, [NodeSpec("a", 8), NodeSpec("b", 8), NodeSpec("four", 4)])
    assert plan.stages_of("big") == [["a"], ["b"]]
    assert plan.stages_of("small") == [["four"]] * 4
    assert plan.free_gpus == {"a": 0, "b": 0, "four": 0}


def test_typed_replicas_land_on_their_type_and_untyped_ones_on_any_node():
    nodes = [NodeSpec("h", 8, accelerator_type="H100"), NodeSpec("a", 8, accelerator_type="A100")]
    demands = [ReplicaDemand("any", "default", EngineLayout(4), 2),
               ReplicaDemand("h100", "default", EngineLayout(8, 1, "H100"), 1)]
    plan = plan_cluster(demands, nodes)
    assert plan.stages_of("h100") == [["h"]] and plan.stages_of("any") == [["a"], ["a"]]
    with pytest.raises(PlacementError, match="none has them"):  # the H100 node is taken by untyped replicas
        plan_cluster([ReplicaDemand("any", "default", EngineLayout(8), 1), *demands[1:]],
                     [NodeSpec("h", 8, accelerator_type="H100")])


@pytest.mark.parametrize("model,message", [
    (_gpu_model("m", tp=16), r"models\[m\]: tensor_parallel_size 16 exceeds the 8 GPUs of the largest node"),
    (_gpu_model("m", tp=8, pp=3), r"models\[m\]: one replica needs 24 GPUs \(TP 8 x PP 3\); the cluster has 16"),
    (_gpu_model("m", accelerator_type="A100"), r"no node has accelerator_type 'A100' \(nodes have: H100\)"),
    (_gpu_model("m", tp=4, replicas=5), r"replica 5 of 5.*its 5 replicas need 20 GPUs in all"),
])
def test_a_declared_cluster_refuses_what_cannot_be_placed(model, message):
    cfg = parse_config({"models": [model], "cluster": _cluster(("gpu", 2, 8, "H100"))})
    with pytest.raises(ConfigError, match=message) as err:
        check_placement(cfg, NO_LIVE_GPUS)
    assert str(err.value).startswith("this config does not fit the declared cluster")


def test_replicas_that_do_not_fit_name_the_models_placed_before_them():
    cfg = parse_config({"models": [_gpu_model("first", tp=8), _gpu_model("second", tp=4, replicas=2)],
                        "cluster": _cluster(("gpu", 1, 12, None))})
    with pytest.raises(ConfigError, match=r"models\[second\]: replica 2 of 2.*placed before it: first=8, second=4"):
        check_placement(cfg, NO_LIVE_GPUS)


def test_every_layout_problem_of_a_config_is_listed_at_once():
    cfg = parse_config({"models": [_gpu_model("wide", tp=16), _gpu_model("typed", accelerator_type="A100")],
                        "cluster": _cluster(("gpu", 2, 8, "H100"))})
    with pytest.raises(ConfigError) as err:
        check_placement(cfg, NO_LIVE_GPUS)
    assert "models[wide]: tensor_parallel_size 16 exceeds" in str(err.value)
    assert "models[typed]: no node has accelerator_type 'A100'" in str(err.value)


@pytest.mark.parametrize("specs,nodes", [
    (["8"], [("node-0", 8, None)]),
    ([" 2x4 "], [("node-0", 4, None), ("node-1", 4, None)]),
    (["1x8xA100-80G", "2xH100"], [("node-0", 8, "A100-80G"), ("node-1", 2, "H100")]),
])
def test_node_specs_parse_into_numbered_nodes(specs, nodes):
    assert [(n.name, n.gpus, n.accelerator_type) for n in parse_nodes(specs)] == nodes


@pytest.mark.parametrize("spec", ["", "x8", "2x", "8 GPUs", "-1", "H100", "2x8x", "0x8xH100"])
def test_malformed_node_specs_are_refused(spec):
    with pytest.raises(ValueError, match="expected COUNTxGPUS"):
        parse_nodes([spec])


def test_the_live_gpu_nodes_are_planned_on_when_the_config_declares_none():
    live = ClusterView(has_gpus=True, largest_node_cpus=8, gpu_nodes=(NodeSpec("n1", 4), NodeSpec("n2", 8)))
    cfg = parse_config({"models": [_gpu_model("m", tp=4, replicas=3)]})
    assert cluster_nodes(cfg, live) == list(live.gpu_nodes)
    assert check_placement(cfg, live).stages_of("m") == [["n1"], ["n2"], ["n2"]]


def test_gpu_models_without_any_node_are_not_checked_and_say_so(caplog):
    cfg = parse_config({"models": [_gpu_model("m", tp=64, replicas=9)]})
    assert check_placement(cfg, NO_LIVE_GPUS) is None
    assert "no GPU node is visible" in caplog.text


def test_cpu_only_configs_have_no_gpu_plan_even_with_a_cluster():
    cfg = parse_config({"models": [{"name": "smol", "source": "builtin:smollm2-135m-instruct", "accelerator": "cpu"}],
                        "cluster": _cluster(("gpu", 1, 8, None))})
    assert check_placement(cfg, NO_LIVE_GPUS) is None


def test_a_versioned_model_asks_for_the_versions_that_may_run_at_once_largest_first():
    cfg = parse_config({"models": [
        {"name": "m", "accelerator": "gpu", "autoscaling": {"min_replicas": 1, "max_replicas": 3}, "versions": [
            {"name": "live", "source": "org/x", "weight": 100},
            {"name": "wide", "source": "org/x", "engine": {"tensor_parallel_size": 4}},
            {"name": "mid", "source": "org/x", "engine": {"tensor_parallel_size": 2}}]},
        {"name": "cpu", "source": "builtin:smollm2-135m-instruct", "accelerator": "cpu"}]})
    accelerators = {"m": "gpu", "cpu": "cpu"}
    most = replica_demands(cfg, accelerators)
    assert [(d.model, d.version, d.layout.devices, d.count) for d in most] == [("m", "wide", 4, 3), ("m", "mid", 2, 3)]
    least = replica_demands(cfg, accelerators, least=True)
    assert [(d.version, d.count) for d in least] == [("wide", 1)]
