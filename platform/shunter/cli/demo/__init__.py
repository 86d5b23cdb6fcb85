"""`shunter demo`: see the dashboards without a Grafana server.

It serves a config on a local Ray cluster (with Ray's metrics exporter on a known port), runs a local
Prometheus scraping that exporter every two seconds (shunter.cli.demo.prometheus; `make prometheus` installs
it), drives a short shared-prefix load with `shunter bench`'s load generator, and renders the key panels
of the shipped dashboards (ops/grafana) to PNG files from Prometheus's answers to their own PromQL
(shunter.cli.demo.panels). The PNGs show what an operator's Grafana shows for the same run.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

from shunter.local_serve import local_serve

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]  # platform/shunter/cli/demo/__init__.py -> the repository
# The panels each PNG shows: the ones an operator looks at first.
KEY_PANELS: dict[str, list[str]] = {
    "shunter-overview": ["Requests/s by model", "Time to first token", "Inter-token latency", "End-to-end latency",
                         "Output tokens/s by model", "Error ratio by model"],
    "shunter-capacity": ["Requests in flight", "Engine requests running per replica", "KV-cache usage per replica",
                         "Replicas: routable, desired, running"],
    "shunter-routing": ["Routing decisions/s by reason", "Prefix match ratio (router's estimate)",
                        "Engine prefix-cache hit rate per replica"],
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shunter demo", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "local.yaml")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the model the load goes to")
    p.add_argument("--duration", type=float, default=90, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboards")
    p.add_argument("--rate-interval", default="20s", help="what the panels' $__rate_interval means here")
    return p


def main(argv: list[str] | None = None) -> int:
    from shunter.cli.demo.panels.render import render_all
    from shunter.cli.demo.prometheus import Prometheus, PrometheusMissing, prometheus_binary

    args = parser().parse_args(argv)
    try:
        prometheus_binary()  # before the engines take a minute to start
    except PrometheusMissing as exc:
        raise SystemExit(f"shunter demo: {exc}") from None
    # Ray's processes export metrics every 10 s by default: panels over a 90 s run would move in 10 s
    # steps. Every 2 s, like the scrape, for this run's own cluster.
    os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")
    with local_serve(metrics=True) as local:
        print(f"starting {args.config} (the engines take a minute)...", flush=True)
        local.deploy(*_app(args.config), timeout_s=600)
        assert local.metrics_url is not None
        target = local.metrics_url.removeprefix("http://").removesuffix("/metrics")
        with Prometheus([target], scrape_interval_s=2.0) as prometheus:
            prometheus.wait_scraped()
            start = time.time()
            summary = _load(local.base_url, args)
            time.sleep(10)  # the last requests' metrics reach the exporter and a scrape
            written = render_all(ROOT / "ops" / "grafana", prometheus, args.out, start, time.time(), KEY_PANELS,
                                 step_s=2.0, rate_interval=args.rate_interval)
    print(f"load: {summary['requests']} requests, {summary['output_tokens_per_s']:.0f} output tokens/s")
    for path in written:
        print(f"wrote {path}")
    return 0


def _app(config: Path) -> tuple[Any, str]:
    """The config's Shunter application, built as `serve deploy` would build it, and its name."""
    import yaml

    from shunter.deployments.app import build_app

    apps = yaml.safe_load(config.read_text())["applications"]
    app = next(a for a in apps if a.get("import_path", "").startswith("shunter.deployments.app"))
    return build_app(app["args"]), app["name"]


def _load(base: str, args: argparse.Namespace) -> dict[str, Any]:
    from shunter.bench.runner import run, run_parser

    bench = run_parser().parse_args([
        "--base-url", f"{base}/v1", "--model", args.model, "--workload", "shared-prefix", "--groups", "3",
        "--users", "6", "--system-len", "512", "--output-len", "uniform:16:48",
        "--concurrency", str(args.concurrency), "--duration", str(args.duration), "--quiet"])
    return run(bench)["summary"]
