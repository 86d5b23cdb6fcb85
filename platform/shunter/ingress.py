"""How HTTP reaches the gateway: Ray Serve's direct ingress behind HAProxy (`RAY_SERVE_ENABLE_HA_PROXY=1`).

Without it every HTTP request and every streamed chunk crosses Ray's proxy actor: one actor call per
request for its body, one Ray message per chunk from the gateway to the proxy. With it each gateway
replica runs its own HTTP server (uvicorn, on `http_options.host` at a port from 30000-31000) and the
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
# HAProxy's worker threads (Ray's default 4). With more than one, a client that hangs up on a whole
# (not streamed) request was often not passed on to the gateway: of 4 concurrent clients timing out,
# 2-3 requests ran to completion (and counted as 200) through a 4-thread HAProxy, none through one
# thread or straight to the gateway (2026-11-26, tests/e2e/test_api_keys_hostile.py's hang-up test).
# One thread forwards far more than an LLM node streams.
HAPROXY_THREADS = "RAY_SERVE_HAPROXY_NBTHREAD"


def direct_ingress_wanted() -> bool:
    """Whether clusters get direct ingress: Ray's own variable when set, else `SHUNTER_INGRESS` (direct)."""
    if HA_PROXY in os.environ:
        return os.environ[HA_PROXY] == "1"
    mode = os.environ.get("SHUNTER_INGRESS", "direct")
    if mode not in ("direct", "proxy"):
        raise SystemExit(f"SHUNTER_INGRESS={mode!r}: expected 'direct' (HAProxy to the gateways) or 'proxy' "
                         "(Ray's proxy actor)")
    return mode == "direct"


def direct_ingress_env() -> dict[str, str]:
    """The variables every process of a Ray cluster needs for direct ingress (an operator's own
    `RAY_SERVE_HAPROXY_NBTHREAD` kept)."""
    return {HA_PROXY: "1", HAPROXY_THREADS: os.environ.get(HAPROXY_THREADS, "1")}


def cluster_env() -> dict[str, str]:
    """`direct_ingress_env()` when direct ingress is wanted, else nothing (Ray's default)."""
    return direct_ingress_env() if direct_ingress_wanted() else {}
