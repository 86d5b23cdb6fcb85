"""How HTTP reaches the gateway: Ray Serve's direct ingress behind HAProxy (`RAY_SERVE_ENABLE_HA_PROXY=1`).

Without it every HTTP request and every streamed chunk crosses Ray's proxy actor: one actor call per
request for its body, one Ray message per chunk from the gateway to the proxy. With it each gateway
replica runs its own HTTP server (uvicorn, on a port from 30000-31000 on every interface) and the
HAProxy that Serve starts on each proxy node forwards the client's connection to it; routing among
gateway replicas, health checks and draining stay Serve's. Measured on this project's 2-core machine
(docs/design.md, "The data path's cost per token"): 0.84 of vLLM's own server at 32 streams against
0.75 without it, serving CPU 471 against 781 ms per 1k tokens, in the same run.

These are Ray variables, read by every process of the cluster (the Serve controller, the proxies, the
replicas), so they must be in the environment of whatever starts the cluster: `ray start` in a shell,
the pods' env (`shunter render kuberay` writes them), or, for a cluster started by this process
(`shunter serve`, bench, demo, the tests), `os.environ` before `ray.init`
(`shunter.local_serve.local_cluster_env`).
`SHUNTER_INGRESS=proxy` keeps Ray's proxy actor; a `RAY_SERVE_ENABLE_HA_PROXY` already set wins.
"""

from __future__ import annotations

import os

HA_PROXY = "RAY_SERVE_ENABLE_HA_PROXY"


def direct_ingress_wanted(environ: dict[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    if HA_PROXY in environ:
        return environ[HA_PROXY] == "1"
    mode = environ.get("SHUNTER_INGRESS", "direct")
    if mode not in ("direct", "proxy"):
        raise SystemExit(f"SHUNTER_INGRESS={mode!r}: expected 'direct' (HAProxy to the gateways) or 'proxy' "
                         "(Ray's proxy actor)")
    return mode == "direct"


def cluster_env() -> dict[str, str]:
    """The variables a Ray cluster started by its operator (pods, `ray start`) needs for direct ingress;
    empty when it is not wanted."""
    return {HA_PROXY: "1"} if direct_ingress_wanted() else {}
