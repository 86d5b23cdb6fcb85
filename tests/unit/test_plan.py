"""The builder's placement plan: accelerators, cores per CPU replica, GPU bundles."""

from __future__ import annotations

import pytest

from deployments.app import ClusterView, deployment_name, plan_deployments
from shunter.config import ConfigError, parse_config

SMOL = {"name": "smol", "source": "builtin:smollm2-135m-instruct"}
MINI = {"name": "mini", "source": "builtin:all-minilm-l6-v2", "task": "embed"}
CPU2 = ClusterView(has_gpus=False, largest_node_cpus=2)


def test_two_cpu_engines_on_two_cores_get_one_core_each():
    plans = plan_deployments(parse_config({"models": [SMOL, MINI]}), CPU2)
    for plan in (p for versions in plans.values() for p in versions.values()):
        assert plan["accelerator"] == "cpu" and plan["cpu_cores"] == 1
        assert plan["deployment"]["ray_actor_options"] == {"num_cpus": 1}


def test_a_lone_cpu_engine_gets_every_core():
    plans = plan_deployments(parse_config({"models": [SMOL]}), CPU2)
    assert plans["smol"]["default"]["cpu_cores"] == 2


def test_explicit_cores_win_and_must_fit_tp():
    cfg = parse_config({"models": [{**SMOL, "cpu_cores_per_replica": 2, "engine": {"tensor_parallel_size": 3}}]})
    with pytest.raises(ConfigError, match=r"2 cores cannot host 3 engine ranks"):
        plan_deployments(cfg, CPU2)


def test_gpu_cluster_gets_gpu_options():
    gpus = ClusterView(has_gpus=True, largest_node_cpus=32)
    cfg = parse_config({"models": [SMOL, {**MINI, "accelerator": "cpu"},
                                   {"name": "big", "source": "org/big", "engine": {"tensor_parallel_size": 4}}]})
    plans = plan_deployments(cfg, gpus)
    assert plans["smol"]["default"]["deployment"]["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    assert plans["mini"]["default"]["accelerator"] == "cpu" and plans["mini"]["default"]["cpu_cores"] == 32
    big = plans["big"]["default"]["deployment"]
    assert len(big["placement_group_bundles"]) == 4 and big["placement_group_bundles"][0] == {"CPU": 1, "GPU": 1}


def test_deployment_names_are_plain_and_unique():
    assert deployment_name(parse_config({"models": [{**SMOL, "name": "org/Model-7B.v1"}]}).models[0]) == \
        "model-org-Model-7B-v1"
    cfg = parse_config({"models": [{**SMOL, "name": "a.b"}, {**SMOL, "name": "a/b"}]})
    with pytest.raises(ConfigError, match="same deployment name"):
        plan_deployments(cfg, CPU2)


def test_replicas_drain_longer_than_rays_default_and_the_gateway_outlasts_them():
    from deployments.app import assemble

    cfg = parse_config({"models": [SMOL, {**MINI, "draining": {"timeout_s": 600}}]})
    plans = plan_deployments(cfg, CPU2)
    assert plans["smol"]["default"]["deployment"]["graceful_shutdown_timeout_s"] > 300, "the default drain is 300 s"
    assert plans["mini"]["default"]["deployment"]["graceful_shutdown_timeout_s"] > 600
    gateway = assemble(cfg)._bound_deployment
    assert gateway._deployment_config.graceful_shutdown_timeout_s > 600


def test_updates_start_replacements_first_where_they_fit():
    gpus = ClusterView(has_gpus=True, largest_node_cpus=8)
    assert plan_deployments(parse_config({"models": [SMOL]}), gpus)["smol"]["default"]["deployment"]["max_surge_percent"] == 100
    # Two CPU engines fill a 2-core node: a replacement could not be placed, so stop first.
    full = plan_deployments(parse_config({"models": [SMOL, MINI]}), CPU2)
    assert full["smol"]["default"]["deployment"]["max_surge_percent"] == 0
    roomy = plan_deployments(parse_config({"models": [{**SMOL, "cpu_cores_per_replica": 1}]}), CPU2)
    assert roomy["smol"]["default"]["deployment"]["max_surge_percent"] == 100
    forced = parse_config({"models": [{**SMOL, "draining": {"surge_percent": 50}}, MINI]})
    assert plan_deployments(forced, CPU2)["smol"]["default"]["deployment"]["max_surge_percent"] == 50
