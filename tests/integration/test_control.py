"""The cluster-side control state (ops/control.py) on a real local Ray cluster: what a process that has
since exited wrote survives the death of the control actor, readers see it without calling the actor,
and it holds only for the config it was written against."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.integration.local_app import ROOT

pytestmark = pytest.mark.own_cluster

CONTEXT = {"model": "smol", "fingerprint": "f1", "versions": ["v1", "v2"], "file_weights": [["v1", 100.0], ["v2", 0.0]],
           "deployments": {"v1": "model-smol--v1", "v2": "model-smol--v2"}, "ready_replicas": 1, "rollout": {}}
WRITER = f"""
import sys
import ray
from shunter.ops.control import control

ray.init(address=sys.argv[1], namespace="writer")
ray.get(control("app1").set_weights.remote({CONTEXT!r}, [("v2", 10), ("v1", 90)]))
"""


@pytest.fixture(scope="module")
def gcs_address() -> Iterator[str]:
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, namespace="tests",
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def test_state_written_by_a_process_that_ended_survives_the_actor_dying(gcs_address):
    import ray

    from shunter.ops.control import NAMESPACE, RolloutRefused, actor_name, control, model_view, read_state

    # Another process (like a CLI) writes, then exits. `ray.init` turned token auth on.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "token"}
    written = subprocess.run([sys.executable, "-c", WRITER, gcs_address], cwd=ROOT, capture_output=True,
                             text=True, env=env, timeout=120)
    assert written.returncode == 0, written.stderr[-2000:]
    file_weights = [("v1", 100.0), ("v2", 0.0)]
    view = model_view(read_state("app1"), "smol", "f1", file_weights)
    assert view.weights == (("v2", 10.0), ("v1", 90.0)) and view.live == {"v1", "v2"} and view.source == "live"
    other_config = model_view(read_state("app1"), "smol", "f2", file_weights)
    assert other_config.weights == tuple(file_weights) and other_config.live == {"v1"}, \
        "a redeploy with another config starts from the file"

    actor = control("app1")
    ray.kill(ray.get_actor(actor_name("app1"), namespace=NAMESPACE), no_restart=False)
    deadline = time.monotonic() + 60
    while True:
        try:
            state = ray.get(actor.state_now.remote(), timeout=10)
            break
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline, "the control actor did not restart"
            time.sleep(1)
    assert state["models"]["smol"]["weights"] == [["v2", 10.0], ["v1", 90.0]], "the restarted actor reloaded it"
    with pytest.raises(RolloutRefused, match="one above"):
        ray.get(actor.set_weights.remote(CONTEXT, [("v1", 0)]))
    with pytest.raises(RolloutRefused, match="no version 'v9'"):
        ray.get(actor.start_rollout.remote(CONTEXT, "v9"))
    with pytest.raises(RolloutRefused, match="splits its traffic"):
        ray.get(actor.start_rollout.remote(CONTEXT, "v2"))
