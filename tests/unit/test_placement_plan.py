"""The placement planner: the shipped GPU configs, fragmentation, impossible requests, `shunter plan`."""

from __future__ import annotations

from pathlib import Path

import pytest

from shunter.cli import load_app_configs
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
)
from shunter.serve_plan import ClusterView, check_placement, cluster_nodes, plan_deployments

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NO_LIVE_GPUS = ClusterView(has_gpus=False, largest_node_cpus=2)
H100 = "accelerator_type:H100"


def _config(name: str):
    ((_, cfg),) = load_app_configs(CONFIGS / name)
    return cfg


def _stages(plan, model: str) -> list[list[str]]:
    return plan.stages_of(model)


def test_an_8b_model_takes_one_l4_node_per_replica():
    cfg = _config("gpu-llama-8b.yaml")
    plan = check_placement(cfg, NO_LIVE_GPUS)
    assert _stages(plan, "llama-3.1-8b-instruct") == [["gpu-l4-0"], ["gpu-l4-1"], ["gpu-l4-2"], ["gpu-l4-3"]]
    actor = plan_deployments(cfg, NO_LIVE_GPUS)["llama-3.1-8b-instruct"]["default"]["deployment"]["ray_actor_options"]
    assert actor == {"num_cpus": 1, "num_gpus": 1, "resources": {"accelerator_type:L4": 0.001}}


def test_a_70b_model_at_tp4_is_one_strict_pack_group_per_replica_on_one_node():
    cfg = _config("gpu-llama-70b-tp4.yaml")
    plan = check_placement(cfg, NO_LIVE_GPUS)
    assert _stages(plan, "llama-3.3-70b-instruct") == [["gpu-h100-0"], ["gpu-h100-0"]]
    options = plan_deployments(cfg, NO_LIVE_GPUS)["llama-3.3-70b-instruct"]["default"]["deployment"]
    bundles = options["placement_group_bundles"]
    assert options["placement_group_strategy"] == "STRICT_PACK" and len(bundles) == 4
    assert bundles[0]["CPU"] == 1 and all(b["GPU"] == 1 and b[H100] > 0 for b in bundles)
    assert options["ray_actor_options"] == {"num_cpus": 1}, "the actor sits in bundle 0 and takes no GPU"


def test_a_405b_model_at_tp8_pp2_puts_its_stages_on_two_nodes():
    cfg = _config("gpu-llama-405b-tp8-pp2.yaml")
    plan = check_placement(cfg, NO_LIVE_GPUS)
    assert _stages(plan, "llama-3.1-405b-instruct") == [["gpu-h100-0", "gpu-h100-1"]]
    options = plan_deployments(cfg, NO_LIVE_GPUS)["llama-3.1-405b-instruct"]["default"]["deployment"]
    assert "placement_group_bundles" not in options, "the replica reserves its stages itself"
    assert options["ray_actor_options"] == {"num_cpus": 1, "resources": {H100: 0.001}}


def test_the_multi_model_config_fits_four_nodes_with_whole_nodes_for_the_big_stages():
    plan = check_placement(_config("gpu-multi-model.yaml"), NO_LIVE_GPUS)
    assert _stages(plan, "llama-3.1-405b-instruct") == [["gpu-h100-0", "gpu-h100-1"]]
    assert _stages(plan, "llama-3.3-70b-instruct") == [["gpu-h100-2"], ["gpu-h100-2"]]
    assert _stages(plan, "llama-3.1-8b-instruct") == [["gpu-h100-3"]] * 4
    assert plan.free_gpus == {"gpu-h100-0": 0, "gpu-h100-1": 0, "gpu-h100-2": 0, "gpu-h100-3": 4}


def test_a_stage_never_straddles_nodes_even_when_gpus_are_free_in_pieces():
    nodes = [NodeSpec("three", 3), NodeSpec("two-a", 2), NodeSpec("two-b", 2)]
    plan = plan_cluster([ReplicaDemand("m", "default", EngineLayout(2, 2), 1)], nodes)
    assert plan.replicas[0].stage_nodes == ["two-a", "two-b"], "best fit: the 3-GPU node keeps room"
    with pytest.raises(PlacementError, match="needs 2 free GPUs on one node"):
        plan_cluster([ReplicaDemand("m", "default", EngineLayout(2, 2), 2)], nodes)  # 7 GPUs, 3 pairs


def test_small_replicas_fill_fragments_and_leave_whole_nodes_to_big_stages():
    nodes = [NodeSpec("a", 8), NodeSpec("b", 8), NodeSpec("small", 4)]
    demands = [ReplicaDemand("small", "default", EngineLayout(1), 4),
               ReplicaDemand("big", "default", EngineLayout(8, 2), 1)]
    plan = plan_cluster(demands, nodes)
    assert plan.stages_of("big") == [["a", "b"]] and plan.stages_of("small") == [["small"]] * 4


@pytest.mark.parametrize("layout,nodes,message", [
    (EngineLayout(16), [NodeSpec("a", 8), NodeSpec("b", 8)], "exceeds the 8 GPUs of the largest node"),
    (EngineLayout(8, 4), [NodeSpec("a", 8), NodeSpec("b", 8)], "needs 32 GPUs .*the cluster has 16"),
    (EngineLayout(4, 1, "H100"), [NodeSpec("a", 8, accelerator_type="A100")], "no node has accelerator_type 'H100'"),
])
def test_impossible_layouts_are_refused_with_the_reason(layout, nodes, message):
    with pytest.raises(PlacementError, match=message):
        plan_cluster([ReplicaDemand("m", "default", layout, 1)], nodes)


def test_too_many_replicas_name_what_took_the_gpus():
    demands = [ReplicaDemand("big", "default", EngineLayout(8), 1), ReplicaDemand("m", "default", EngineLayout(1), 2)]
    with pytest.raises(PlacementError, match=r"replica 2 of 2.*placed before it: big=8, m=1"):
        plan_cluster(demands, [NodeSpec("a", 9)])


def test_the_config_check_lists_every_problem_at_once():
    cfg = parse_config({"models": [
        {"name": "a", "source": "meta-llama/Llama-3.1-8B-Instruct", "accelerator": "gpu",
         "engine": {"tensor_parallel_size": 3}},
        {"name": "b", "source": "meta-llama/Llama-3.1-70B-Instruct", "accelerator": "gpu",
         "engine": {"pipeline_parallel_size": 81}},
    ]})
    with pytest.raises(ConfigError) as err:
        check_placement(cfg, NO_LIVE_GPUS)
    assert "models[a]: tensor_parallel_size 3 does not divide the model's 32 attention heads" in str(err.value)
    assert "models[b]: pipeline_parallel_size 81 exceeds the model's 80 layers" in str(err.value)


def test_a_declared_cluster_is_a_hard_limit_and_the_live_one_only_warns(caplog):
    model = {"name": "m", "source": "meta-llama/Llama-3.1-70B-Instruct", "accelerator": "gpu", "replicas": 3,
             "engine": {"tensor_parallel_size": 4}}
    live = ClusterView(has_gpus=True, largest_node_cpus=8, gpu_nodes=(NodeSpec("live", 8),))
    assert check_placement(parse_config({"models": [model]}), live) is None
    assert "wait for the autoscaler" in caplog.text
    declared = {"node_groups": [{"name": "gpu", "count": 1, "gpus_per_node": 8}]}
    with pytest.raises(ConfigError, match="does not fit the declared cluster"):
        check_placement(parse_config({"models": [model], "cluster": declared}), live)
    assert [n.name for n in cluster_nodes(parse_config({"models": [model], "cluster": declared}), live)] == ["gpu-0"]


def test_without_any_nodes_gpu_models_are_not_checked_but_are_planned():
    cfg = parse_config({"models": [{"name": "m", "source": "org/unknown", "accelerator": "gpu",
                                    "engine": {"tensor_parallel_size": 2}}]})
    assert check_placement(cfg, NO_LIVE_GPUS) is None
    assert plan_deployments(cfg, NO_LIVE_GPUS)["m"]["default"]["deployment"]["placement_group_strategy"] == "STRICT_PACK"


def test_a_rollout_is_planned_with_room_for_two_versions_the_largest_first():
    cfg = parse_config({"models": [{"name": "m", "accelerator": "gpu", "replicas": 1, "versions": [
        {"name": "small", "source": "org/x", "weight": 100},
        {"name": "big", "source": "org/x", "engine": {"tensor_parallel_size": 4}},
        {"name": "mid", "source": "org/x", "engine": {"tensor_parallel_size": 2}}]}],
        "cluster": {"node_groups": [{"name": "gpu", "count": 1, "gpus_per_node": 6}]}})
    plan = check_placement(cfg, NO_LIVE_GPUS)
    assert sorted(r.version for r in plan.replicas) == ["big", "mid"], "two versions run at once in a rollout"


def test_layout_requests_pin_each_rank_to_its_stage_node():
    layout = EngineLayout(2, 2, "H100")
    assert layout.stage_bundles() == [{"GPU": 2.0, H100: 0.001}] * 2
    bundles, selectors = layout.engine_bundles(["n0", "n1"])
    assert bundles == [{"GPU": 1.0, H100: 0.001}] * 4
    assert [s[NODE_ID_LABEL] for s in selectors] == ["n0", "n0", "n1", "n1"]
    with pytest.raises(ValueError):
        layout.engine_bundles(["n0"])


def test_node_specs_parse():
    assert [(n.gpus, n.accelerator_type) for n in parse_nodes(["2x8xH100", "4"])] == [(8, "H100"), (8, "H100"), (4, None)]
    with pytest.raises(ValueError, match="COUNTxGPUS"):
        parse_nodes(["eight"])


def test_shunter_plan_prints_the_stages_and_fails_on_a_misfit(capsys, tmp_path):
    assert shunter(["plan", str(CONFIGS / "gpu-llama-405b-tp8-pp2.yaml")]) == 0
    assert "replica 1: stage 1 -> gpu-h100-0, stage 2 -> gpu-h100-1" in capsys.readouterr().out
    assert shunter(["plan", str(CONFIGS / "gpu-llama-405b-tp8-pp2.yaml"), "--nodes", "1x8xH100"]) == 1
    assert "one replica needs 16 GPUs (TP 8 x PP 2); the cluster has 8" in capsys.readouterr().out
    bare = tmp_path / "bare.yaml"
    bare.write_text("applications:\n- name: s\n  import_path: shunter.deployments.app:build_app\n  args:\n"
                    "    models: [{name: m, source: org/m, accelerator: gpu}]\n")
    with pytest.raises(SystemExit, match="--nodes"):
        shunter(["plan", str(bare)])
