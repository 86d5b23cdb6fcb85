"""Direct ingress (Ray Serve's HAProxy in front of the gateways' own HTTP servers): who decides it, what a
cluster started on this machine gets, and what the KubeRay pods get."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from shunter.cli import load_app_configs
from shunter.cluster_quiet import QUIET, quiet_env
from shunter.ingress import (
    HA_PROXY,
    HAPROXY_BINARY,
    HAPROXY_THREADS,
    IMAGE_HAPROXY_WRAPPER,
    cluster_env,
    direct_ingress_wanted,
)
from shunter.kuberay import render_rayservice
from shunter.local_serve import MIN_DRAINING, local_cluster_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def environ(monkeypatch):
    for name in (HA_PROXY, HAPROXY_THREADS, HAPROXY_BINARY, "SHUNTER_INGRESS", MIN_DRAINING, *QUIET):
        monkeypatch.delenv(name, raising=False)  # the suite's own pace (tests/integration/local_app.py) aside
    return monkeypatch


def test_direct_ingress_is_the_default_and_ray_s_own_variable_wins(environ):
    # One HAProxy thread: with Ray's 4, clients' hang-ups often did not reach the gateway (ingress.py).
    assert direct_ingress_wanted() and cluster_env() == {HA_PROXY: "1", HAPROXY_THREADS: "1",
                                                         HAPROXY_BINARY: IMAGE_HAPROXY_WRAPPER}
    environ.setenv(HAPROXY_THREADS, "2")  # an operator's own choice is kept
    assert cluster_env()[HAPROXY_THREADS] == "2"
    environ.setenv("SHUNTER_INGRESS", "proxy")
    assert not direct_ingress_wanted() and cluster_env() == {}
    environ.setenv(HA_PROXY, "1")  # set by the operator: Ray reads it, so it is what happens
    assert direct_ingress_wanted()
    environ.setenv(HA_PROXY, "0")
    environ.setenv("SHUNTER_INGRESS", "direct")
    assert not direct_ingress_wanted()


def test_an_unknown_ingress_mode_is_refused_by_name(environ):
    environ.setenv("SHUNTER_INGRESS", "haproxy")
    with pytest.raises(SystemExit, match="SHUNTER_INGRESS='haproxy'.*'direct'.*'proxy'"):
        direct_ingress_wanted()


def test_each_local_cluster_gets_its_own_haproxy_files_and_ports(environ):
    first, second = local_cluster_env(), local_cluster_env()
    assert first[HA_PROXY] == second[HA_PROXY] == "1" and first[HAPROXY_THREADS] == "1"
    for env in (first, second):
        folder = env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]
        assert os.path.isdir(folder) and folder != "/tmp/haproxy-serve"
        for name in ("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "RAY_SERVE_HAPROXY_SOCKET_PATH",
                     "RAY_SERVE_HAPROXY_SERVER_STATE_FILE"):
            assert env[name].startswith(folder + os.sep)
        assert int(env["RAY_SERVE_HAPROXY_STATS_PORT"]) not in (8404, 0)
        assert env[MIN_DRAINING] == "2"  # nothing in front of a one-machine cluster to wait for
    assert first["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] != second["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]
    assert first["RAY_SERVE_HAPROXY_STATS_PORT"] != first["RAY_SERVE_HAPROXY_METRICS_PORT"]


def test_a_local_cluster_runs_haproxy_without_splicing_so_a_clients_close_reaches_the_gateway(environ, tmp_path):
    """With Ray's `option splice-request`, HAProxy never passes on the close of a client whose body came
    after its headers (ingress.py): each local cluster's HAProxy runs through a wrapper adding `-dS`."""
    import subprocess

    env = local_cluster_env()
    wrapper = env[HAPROXY_BINARY]
    assert wrapper.startswith(env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] + os.sep) and os.access(wrapper, os.X_OK)
    script = Path(wrapper).read_text()
    assert ' -dS "$@"' in script
    version = subprocess.run([wrapper, "-v"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and "HAProxy version" in version.stdout, version
    environ.setenv(HAPROXY_BINARY, wrapper)  # the next cluster of this process: wraps the binary, not the wrapper
    assert Path(local_cluster_env()[HAPROXY_BINARY]).read_text() == script
    own = tmp_path / "my-haproxy"
    own.write_text("#!/bin/sh\n")
    own.chmod(0o755)
    environ.setenv(HAPROXY_BINARY, str(own))  # an operator's own binary is the one run
    assert f"exec {own} -dS" in Path(local_cluster_env()[HAPROXY_BINARY]).read_text()
    assert HAPROXY_BINARY not in local_cluster_env(direct=False)


def test_a_local_cluster_keeps_an_operator_s_drain_period_and_says_no_when_off(environ):
    environ.setenv(MIN_DRAINING, "30")
    assert local_cluster_env()[MIN_DRAINING] == "30"
    # Said explicitly, so a cluster started after one with direct ingress (same process) is without it.
    assert local_cluster_env(direct=False) == {HA_PROXY: "0", **quiet_env()}
    environ.setenv("SHUNTER_INGRESS", "proxy")
    assert local_cluster_env() == {HA_PROXY: "0", **quiet_env()}
    assert local_cluster_env(direct=True)[HA_PROXY] == "1"  # a caller's explicit choice


def test_every_kuberay_pod_runs_serve_behind_haproxy(environ):
    path = ROOT / "configs" / "gpu-llama-8b.yaml"
    manifest = render_rayservice(yaml.safe_load(path.read_text()), load_app_configs(path), "img:1")
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for pod in pods:
        for container in pod["template"]["spec"]["containers"]:
            assert {"name": HA_PROXY, "value": "1"} in container["env"], container["name"]
            assert {"name": HAPROXY_THREADS, "value": "1"} in container["env"], container["name"]
    environ.setenv("SHUNTER_INGRESS", "proxy")
    manifest = render_rayservice(yaml.safe_load(path.read_text()), load_app_configs(path), "img:1")
    env = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    assert HA_PROXY not in {e["name"] for e in env}, "Ray's proxy actor: no ingress variable at all"


def test_every_cluster_runs_serve_s_periodic_work_at_shunter_s_pace_unless_the_operator_says(environ):
    """Issue 39, no idle tax: Serve's controller loop and metrics export slowed, on a local cluster with or
    without direct ingress and on every KubeRay pod; an operator's own value wins."""
    for env in (local_cluster_env(), local_cluster_env(direct=False)):
        assert {name: env[name] for name in QUIET} == QUIET
    path = ROOT / "configs" / "gpu-llama-8b.yaml"
    manifest = render_rayservice(yaml.safe_load(path.read_text()), load_app_configs(path), "img:1")
    pods = [manifest["spec"]["rayClusterConfig"]["headGroupSpec"],
            *manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    for pod in pods:
        env = {e["name"]: e["value"] for e in pod["template"]["spec"]["containers"][0]["env"]}
        assert {name: env[name] for name in QUIET} == QUIET
    environ.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.2")
    assert local_cluster_env()["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.2"
