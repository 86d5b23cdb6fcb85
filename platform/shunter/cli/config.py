"""`shunter config check FILE`: validate a Serve config as the app builder would, and print the resolved
Shunter config."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    config = sub.add_parser("config", help="work with config files").add_subparsers(dest="action", required=True)
    check = config.add_parser("check", help="validate a Serve config and print the resolved Shunter config")
    check.add_argument("file", type=Path)
    check.set_defaults(func=_config_check)


def _config_check(args: argparse.Namespace) -> int:
    import yaml

    from shunter.cli.app_files import load_app_configs
    from shunter.cli.plan import check_builds

    for name, cfg in load_app_configs(args.file):
        check_builds(args.file, name, cfg)  # what build_app would refuse: splits, GPU placement, CPU cores
        print(f"# application {name!r}: valid")
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())
    return 0
