"""The builder's placement plan: accelerators, cores per CPU replica, GPU bundles."""

from __future__ import annotations

import pytest

from shunter.config import ConfigError, parse_config
from shunter.serve_plan import ClusterView, deployment_name, plan_deployments

SMOL = {"name": "smol", "source": "builtin:smollm2-135m-instruct"}
MINI = {"name": "mini", "source": "builtin:all-minilm-l6-v2", "task": "embed"}
CPU2 = ClusterView(has_gpus=False, largest_node_cpus=2)


def test_two_cpu_engines_on_two_cores_get_one_core_each():
    plans = plan_deployments(parse_config({"models": [SMOL, MINI]}), CPU2)
    for plan in (p for versions in plans.values() for p in versions.values()):
        assert plan["accelerator"] == "cpu" and plan["cpu_cores"] == 1
        assert plan["deployment"]["ray_actor_options"]["num_cpus"] == 1


def test_a_cpu_replica_is_forked_from_the_nodes_server_unless_its_engine_spawns():
    from shunter.worker_fork import EXECUTABLE

    forked = plan_deployments(parse_config({"models": [SMOL]}), CPU2)["smol"]["default"]["deployment"]
    assert forked["ray_actor_options"]["runtime_env"] == {"py_executable": EXECUTABLE}
    spawned = plan_deployments(parse_config({"models": [{**SMOL, "engine": {"process_start": "spawn"}}]}),
                               CPU2)["smol"]["default"]["deployment"]
    assert "runtime_env" not in spawned["ray_actor_options"], "spawn: Ray starts the worker as it always does"


def test_the_gateway_is_forked_only_where_every_model_replica_is():
    from shunter.deployments.app import gateway_actor_options
    from shunter.serve_plan import forks_workers
    from shunter.worker_fork import EXECUTABLE

    forked = forks_workers(plan_deployments(parse_config({"models": [SMOL, MINI]}), CPU2))
    one_spawns = forks_workers(plan_deployments(parse_config(
        {"models": [SMOL, {**MINI, "engine": {"process_start": "spawn"}}]}), CPU2))
    on_gpus = forks_workers(plan_deployments(parse_config({"models": [SMOL, {**MINI, "accelerator": "cpu"}]}),
                                             ClusterView(has_gpus=True, largest_node_cpus=32)))
    assert (forked, one_spawns, on_gpus) == (True, False, False)
    options = gateway_actor_options(True)["runtime_env"]
    assert options["py_executable"] == EXECUTABLE
    assert options["env_vars"] == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}, "its own env is kept"
    assert "py_executable" not in gateway_actor_options(False)["runtime_env"]


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
    from shunter.deployments.app import assemble, deployment_options

    cfg = parse_config({"models": [SMOL, {**MINI, "draining": {"timeout_s": 600}}]})
    plans = deployment_options(cfg, CPU2)
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


# Three one-core engines on a two-core node: Ray would leave the third replica pending forever.
THREE_ON_TWO = {"models": [{**SMOL, "cpu_cores_per_replica": 1},
                           {**SMOL, "name": "smol-b", "cpu_cores_per_replica": 1},
                           {**MINI, "cpu_cores_per_replica": 1}]}
NO_FIT = "the CPU engines this config starts need 3 cores; the node has 2"


def _fix_named(message: str) -> None:
    assert NO_FIT in message
    for model in ("models[smol]: 1 replica", "models[smol-b]: 1 replica", "models[mini]: 1 replica"):
        assert model in message
    assert "cpu_cores_per_replica: shared" in message and "at least 3 cores" in message and "replicas" in message


def test_cpu_engines_that_cannot_all_start_on_the_node_are_refused_naming_models_cores_and_fix():
    with pytest.raises(ConfigError) as err:
        plan_deployments(parse_config(THREE_ON_TWO), CPU2)
    _fix_named(str(err.value))
    auto = parse_config({"models": [{**SMOL, "replicas": 2}, MINI]})  # auto never gives an engine less than a core
    with pytest.raises(ConfigError, match=r"need 3 cores.*\n  models\[smol\]: 2 replicas \(replicas\) x 1 core "
                                          r"\(cpu_cores_per_replica: auto"):
        plan_deployments(auto, CPU2)
    ranks = parse_config({"models": [{**SMOL, "source": "org/x", "cpu_cores_per_replica": 2,
                                      "engine": {"tensor_parallel_size": 2}}, MINI]})
    with pytest.raises(ConfigError, match="need 3 cores"):
        plan_deployments(ranks, CPU2)


def test_build_app_refuses_it_before_anything_starts(monkeypatch):
    from shunter.deployments import app

    monkeypatch.setattr(app.ClusterView, "detect", classmethod(lambda cls: CPU2))
    with pytest.raises(ConfigError) as err:
        app.build_app(THREE_ON_TWO)
    _fix_named(str(err.value))


def test_shared_cores_and_min_replicas_fit_and_scaling_past_the_cores_only_warns(caplog):
    shared = parse_config({"models": [{**SMOL, "cpu_cores_per_replica": 1}, {**SMOL, "name": "smol-b"},
                                      {**MINI, "cpu_cores_per_replica": "shared"}]})
    assert plan_deployments(shared, CPU2)["mini"]["default"]["cpu_cores"] == 0
    elastic = parse_config({"models": [
        {**SMOL, "cpu_cores_per_replica": 1, "autoscaling": {"min_replicas": 1, "max_replicas": 2}},
        {**MINI, "cpu_cores_per_replica": 1, "autoscaling": {"min_replicas": 0, "max_replicas": 1}}]})
    plan_deployments(elastic, CPU2)
    assert "need up to 3 cores at their most; the node has 2: replicas past its cores wait" in caplog.text
    assert "models[smol]: 2 replicas (autoscaling.max_replicas) x 1 core" in caplog.text
    caplog.clear()
    versioned = parse_config({"models": [{"name": "v", "cpu_cores_per_replica": 1, "versions": [
        {"name": "v1", "source": SMOL["source"], "weight": 100}, {"name": "v2", "source": SMOL["source"]}]}, MINI]})
    assert plan_deployments(versioned, CPU2)["v"]["v2"]["cpu_cores"] == 1, "v2 starts only in a rollout"
    assert "a rollout whose new version cannot start is rolled back" in caplog.text
    with pytest.raises(ConfigError, match=r"models\[v\]: 2 replicas \(autoscaling.min_replicas, version v1\)"):
        plan_deployments(parse_config({"models": [{**versioned.models[0].model_dump(mode="json"), "replicas": 1,
                                                   "autoscaling": {"min_replicas": 2, "max_replicas": 2}}, MINI]}),
                         CPU2)


def test_a_cluster_that_may_add_nodes_only_warns_and_a_declared_one_is_not_checked(caplog):
    several = ClusterView(has_gpus=False, largest_node_cpus=2, cpus_fixed=False, cpu_node="the largest Ray node")
    plan_deployments(parse_config(THREE_ON_TWO), several)
    assert "the largest Ray node has 2" in caplog.text and "wait for the autoscaler" in caplog.text
    declared = {**THREE_ON_TWO, "cluster": {"node_groups": [{"name": "cpu", "count": 1, "gpus_per_node": 0,
                                                             "cpus_per_node": 2}]}}
    plan_deployments(parse_config(declared), CPU2)  # KubeRay gives each CPU replica a pod of its own


def test_auto_cores_cover_the_widest_versions_ranks():
    cfg = parse_config({"models": [{"name": "v", "versions": [
        {"name": "v1", "source": "org/x", "weight": 100},
        {"name": "v2", "source": "org/x", "engine": {"tensor_parallel_size": 2}}]}]})
    assert plan_deployments(cfg, CPU2)["v"]["v2"]["cpu_cores"] == 2


def test_config_check_and_plan_refuse_it_with_the_same_message(monkeypatch, tmp_path, capsys):
    import yaml

    from shunter.cli import main as shunter
    from shunter.deployments import app

    here = ClusterView(has_gpus=False, largest_node_cpus=2, cpu_node="this machine")  # what a 2-core machine says
    monkeypatch.setattr(app.ClusterView, "detect", classmethod(lambda cls: here))

    def config(args: dict):
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({"applications": [
            {"name": "s", "import_path": "shunter.deployments.app:build_app", "args": args}]}))
        return str(path)

    with pytest.raises(SystemExit) as err:
        shunter(["config", "check", config(THREE_ON_TWO)])
    assert str(err.value).startswith(f"{tmp_path / 'config.yaml'}: application 's': ")
    _fix_named(str(err.value).replace("this machine", "the node"))
    assert shunter(["plan", config(THREE_ON_TWO)]) == 1
    out = capsys.readouterr().out
    assert "# application 's' on this machine: 2 CPU core(s)" in out
    _fix_named(out.replace("this machine", "the node"))
    shared = {"models": [*THREE_ON_TWO["models"][:2], {**MINI, "cpu_cores_per_replica": "shared"}]}
    assert shunter(["plan", config(shared)]) == 0
    out = capsys.readouterr().out
    assert "mini: CPU, shared cores (owns none)" in out and "CPU cores: 2 of this machine's 2 at start" in out
    assert shunter(["config", "check", config(shared)]) == 0


def test_the_gateway_runs_its_code_on_its_http_servers_loop_and_reserves_no_cpu():
    """Issue 39: the gateway's streams go to uvicorn without crossing Serve's user-code thread; the
    variable reaches only the gateway's processes (its runtime_env), never a model replica's."""
    from shunter.deployments.app import assemble

    app = assemble(parse_config({"models": [SMOL]}))
    gateway = app._bound_deployment
    options = gateway.ray_actor_options
    assert options["num_cpus"] == 0
    assert options["runtime_env"]["env_vars"] == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
    servers = next(arg for arg in gateway.init_args if isinstance(arg, dict) and "smol" in arg)
    server = servers["smol"]["default"]._bound_deployment
    assert "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD" not in str(server.ray_actor_options)
