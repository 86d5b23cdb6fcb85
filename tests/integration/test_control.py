"""The cluster-side control state (ops/control.py) on a real local Ray cluster: it survives the death
of its actor and of the process that wrote it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.integration.fake_app import ROOT

WRITER = """
import sys
import ray
from ops.control import control
ray.init(address=sys.argv[1], namespace="writer")
ray.get(control("app1").set_weights.remote("smol", [("v2", 10), ("v1", 90)]))
ray.get(control("app1").save_rollout.remote("smol", {"phase": "shifting", "step": 0}))
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

    from ops.control import NAMESPACE, actor_name, control

    # Another process (like a rollout CLI) writes, then exits. `ray.init` turned token auth on.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "token"}
    written = subprocess.run([sys.executable, "-c", WRITER, gcs_address], cwd=ROOT, capture_output=True,
                             text=True, env=env, timeout=120)
    assert written.returncode == 0, written.stderr[-2000:]
    actor = control("app1")
    stamp, weights = ray.get(actor.weights.remote())
    assert weights == {"smol": [("v2", 10.0), ("v1", 90.0)]}, "the writer has exited; its state has not"
    assert ray.get(actor.weights.remote(stamp)) == (stamp, None), "an unchanged state is not sent again"

    ray.kill(ray.get_actor(actor_name("app1"), namespace=NAMESPACE), no_restart=False)
    deadline = time.monotonic() + 60
    while True:
        try:
            restarted = ray.get(actor.rollout.remote("smol"), timeout=10)
            break
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline, "the control actor did not restart"
            time.sleep(1)
    assert restarted == {"phase": "shifting", "step": 0}
    assert ray.get(actor.weights.remote())[1] == {"smol": [("v2", 10.0), ("v1", 90.0)]}
    with pytest.raises(ray.exceptions.RayTaskError, match="need a version with weight > 0"):
        ray.get(actor.set_weights.remote("smol", [("v1", 0)]))
