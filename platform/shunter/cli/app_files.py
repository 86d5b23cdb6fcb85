"""Serve config files as the CLI reads them: every Shunter application in one, validated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

APP_IMPORT_PATH = "shunter.deployments.app:build_app"
FORMER_IMPORT_PATH = "deployments.app:build_app"  # before deployments/ installed under shunter


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
        if app.get("import_path") == FORMER_IMPORT_PATH:
            raise SystemExit(f"{path}: applications[{index}].import_path: {FORMER_IMPORT_PATH!r} is now "
                             f"{APP_IMPORT_PATH!r} (everything of Shunter imports under `shunter`)")
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


def generate_model_of(config: Path, name: str) -> tuple[Any, Any, str]:
    """(ShunterConfig, the generate model named `name`, its weights' path) from the first Shunter app of
    a Serve config file; a versioned model gives the version the file sends most traffic (the benchmarks
    measure one set of weights)."""
    from shunter.catalog import resolve_source

    (_, cfg), *_ = load_app_configs(config)
    model = cfg.find_model(name)
    if model is None or model.task != "generate":
        raise SystemExit(f"{name!r} is not a generate model of {config}")
    if model.versioned:
        model = model.for_version(max(model.file_weights(), key=lambda item: item[1])[0])
    return cfg, model, resolve_source(model.source or "", cfg.model_cache_dir)
