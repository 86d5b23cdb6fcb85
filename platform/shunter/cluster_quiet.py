"""Ray Serve's periodic work, slowed to what a serving cluster needs (issue 39: no idle tax).

Ray Serve wakes its controller every 0.1 s (`RAY_SERVE_CONTROL_LOOP_INTERVAL_S`: reconciling deployment
states, autoscaling decisions, health-check bookkeeping) and has every replica and every handle export
its cached metrics every 0.1 s (`RAY_SERVE_METRICS_EXPORT_INTERVAL_MS`). Measured on this project's 2-core
machine with one model at rest (docs/design.md, "The data path, round two"): the controller alone took
29 ms of CPU a second and the GCS it talks to 15; every platform process together 118 ms a second, CPU a
CPU engine loses and a GPU node must keep a core for. At 0.5 s and 1 s the controller took 13, the GCS 7,
and the whole platform 87 ms a second, with no change a user can see: a deployment, a scale decision or
a replica's failure is acted on at most 0.4 s later (autoscaling decisions look at metrics over tens of
seconds), and Serve's own request metrics reach Prometheus at most 0.9 s later (scrapes are 5-15 s apart).

Like direct ingress (shunter.ingress), these are read by every process of the cluster, so they go in the
environment of whatever starts it: `shunter.local_serve.local_cluster_env` for a cluster started here, the
pods' env in the KubeRay rendering (`shunter.kuberay`). An operator's own value of either variable wins.
"""

from __future__ import annotations

import os

# Ray Serve's variable -> Shunter's value (Ray's default in the comment).
QUIET = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",  # 0.1
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",  # 100
}


def quiet_env() -> dict[str, str]:
    """The variables, with an operator's own values kept."""
    return {name: os.environ.get(name, value) for name, value in QUIET.items()}
