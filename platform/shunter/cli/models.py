"""`shunter models prepare|list|pip-names`: the builtin models."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    models = sub.add_parser("models", help="builtin models").add_subparsers(dest="action", required=True)
    prepare = models.add_parser("prepare", help="prepare the builtin models a config uses")
    prepare.add_argument("file", type=Path)
    prepare.set_defaults(func=_models_prepare)
    models.add_parser("list", help="list the builtin models").set_defaults(func=_models_list)
    models.add_parser("pip-names", help="wheels that carry the builtin models").set_defaults(func=_models_pip_names)


def _models_prepare(args: argparse.Namespace) -> int:
    from shunter.catalog import resolve_source
    from shunter.cli.app_files import load_app_configs

    for _, cfg in load_app_configs(args.file):
        for label, source in cfg.builtin_sources():
            path = resolve_source(source, cfg.model_cache_dir)
            print(f"{label}: {source} -> {path}")
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from shunter.catalog import BUILTIN_MODELS

    for model in BUILTIN_MODELS.values():
        tools = f" (tool calls: serving.tool_call_parser {model.tool_call_parser})" if model.tool_call_parser else ""
        print(f"builtin:{model.key:24} {model.task:9} {model.pip_name:28} {model.description}{tools}")
    return 0


def _models_pip_names(args: argparse.Namespace) -> int:
    from shunter.catalog import BUILTIN_MODELS

    print(" ".join(m.pip_name for m in BUILTIN_MODELS.values()))
    return 0
