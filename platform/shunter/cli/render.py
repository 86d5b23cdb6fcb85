"""`shunter render kuberay FILE`: the RayService manifest KubeRay applies."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_IMAGE = "ghcr.io/shunter-ai/shunter:0.1.0-gpu"


def add_parser(sub: Any) -> None:
    render = sub.add_parser("render", help="deployment manifests").add_subparsers(dest="action", required=True)
    kuberay = render.add_parser("kuberay", help="a KubeRay RayService manifest from a Serve config")
    kuberay.add_argument("file", type=Path, help="a Serve config file (configs/*.yaml)")
    kuberay.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    kuberay.add_argument("--image", default=DEFAULT_IMAGE, help=f"the Ray image with Shunter installed "
                         f"(platform/Dockerfile; default {DEFAULT_IMAGE})")
    kuberay.add_argument("--name", default="shunter", help="the RayService's name")
    kuberay.add_argument("--namespace", help="metadata.namespace (default: none, kubectl's -n decides)")
    kuberay.add_argument("--with-volume-claim", action="store_true",
                         help="also write the usage ledger's PersistentVolumeClaim as a second YAML document, for "
                         "`kubectl apply -f` (Terraform's shunter-service module makes the claim itself)")
    kuberay.add_argument("--volume-size", default="10Gi", help="the usage ledger's claim size (default 10Gi)")
    kuberay.set_defaults(func=_render_kuberay)


def _render_kuberay(args: argparse.Namespace) -> int:
    import yaml

    from shunter.cli.app_files import load_app_configs
    from shunter.kuberay import manifest_yaml, render_rayservice, usage_volume_claim

    apps = load_app_configs(args.file)
    manifest = render_rayservice(yaml.safe_load(args.file.read_text()), apps, args.image, args.name, args.namespace)
    text = (f"# Rendered by `shunter render kuberay {args.file}` (image {args.image}); re-render, do not edit.\n"
            + manifest_yaml(manifest))
    if args.with_volume_claim and any(cfg.usage.enabled for _, cfg in apps):
        text += "---\n" + manifest_yaml(usage_volume_claim(args.name, args.namespace, args.volume_size))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    return 0
