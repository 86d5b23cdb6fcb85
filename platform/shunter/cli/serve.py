"""`shunter serve FILE`: serve a config on this machine in the foreground (what `make serve` runs).

Like `serve run FILE`, with one difference that matters to anyone with a request in flight: Ctrl-C stops
gracefully. `serve run` answers Ctrl-C with `serve.shutdown()`, which kills Serve's HTTP proxy at once and
so cuts every open stream, however long the replicas would have drained. Here the first Ctrl-C deletes the
applications (Ray Serve drains each replica: an idle one stops in about a second, a busy one once its
requests end, up to the model's `draining.timeout_s`), and only then shuts Serve and Ray down. A second
Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve a config on this machine in the foreground (Ctrl-C drains, then "
                                         "stops; twice stops at once)")
    serve.add_argument("file", type=Path, help="a Serve config file, e.g. configs/local.yaml")
    serve.set_defaults(func=serve_main)


def serve_main(args: argparse.Namespace) -> int:
    import yaml

    from shunter.cli.app_files import APP_IMPORT_PATH, load_app_configs

    load_app_configs(args.file)  # a readable error for a bad file, before Ray starts
    raw = yaml.safe_load(args.file.read_text())
    others = [a.get("name", "?") for a in raw["applications"] if a.get("import_path") != APP_IMPORT_PATH]
    if others:
        raise SystemExit(f"{args.file}: `shunter serve` serves Shunter applications (import_path "
                         f"{APP_IMPORT_PATH}); {', '.join(others)} is not one: use `serve run` for it")
    apps = raw["applications"]

    import ray
    from ray import serve

    from shunter.deployments.app import build_app

    http: dict[str, Any] = raw.get("http_options") or {}
    host, port = http.get("host", "127.0.0.1"), http.get("port", 8000)
    names = [a["name"] for a in apps]
    from shunter.local_serve import HAPROXY_FOLDER, local_cluster_env, reap_haproxy

    os.environ.update(local_cluster_env())  # direct ingress (shunter.ingress) for the processes Ray starts
    ray.init(namespace="serve")
    try:
        # Until the applications are deployed, Ctrl-C interrupts the start (KeyboardInterrupt) at once.
        serve.start(proxy_location=raw.get("proxy_location", "HeadOnly"), http_options=http)
        serve.run_many([serve.RunTarget(build_app(a.get("args") or {}), name=a["name"],
                                        route_prefix=a.get("route_prefix", "/")) for a in apps],
                       wait_for_applications_running=False)
        # From here on Ctrl-C drains: a replica may already be answering (its /ready is up) before Serve
        # reports the application RUNNING.
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        print(f"starting {', '.join(names)} on http://{host}:{port}/v1 (the engines take a minute); Ctrl-C "
              "drains and stops", flush=True)
        deployed = _wait_running(serve, names, stop)
        while deployed and not stop.wait(1.0):
            pass
        _drain(serve, names)
    finally:
        serve.shutdown()
        ray.shutdown()
        reap_haproxy(os.environ.get(HAPROXY_FOLDER))
    return 0 if deployed else 1


def _wait_running(serve: Any, names: list[str], stop: threading.Event) -> bool:
    """Report when every application runs (True), or why one failed to deploy (False); True early on
    Ctrl-C."""
    from ray.serve.schema import ApplicationStatus

    while not stop.wait(2.0):
        apps = serve.status().applications
        states = {name: apps[name].status if name in apps else None for name in names}
        failed = [name for name, state in states.items() if state == ApplicationStatus.DEPLOY_FAILED]
        if failed:
            for name in failed:
                print(f"application {name!r} failed to deploy: {apps[name].message}", file=sys.stderr, flush=True)
            return False
        if all(state == ApplicationStatus.RUNNING for state in states.values()):
            print(f"ready: {', '.join(names)}", flush=True)
            return True
    return True


def _drain(serve: Any, names: list[str]) -> None:
    """Delete each application, which makes Ray Serve drain its replicas; a second Ctrl-C skips the wait."""
    print("draining: each replica stops once its requests have finished (Ctrl-C again to stop now)", flush=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    try:
        for name in names:
            serve.delete(name)
    except KeyboardInterrupt:
        print("stopping now", flush=True)
        return
    print(f"drained in {time.monotonic() - started:.1f}s; stopping", flush=True)
