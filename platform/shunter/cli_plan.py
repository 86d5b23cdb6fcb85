"""`shunter plan FILE [--nodes 2x8xH100 ...]`: where every replica's devices would go, before deploying.

Runs the same checks the app builder runs at deploy time (model split, engine settings, capacity) against
the nodes given on the command line, or the config's `cluster:` section, and prints each replica's
pipeline stages with the node that holds them. Exits 1 with the problems when the config cannot be served.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shunter.config import ClusterConfig, ConfigError, NodeGroupConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="where each replica's GPUs would go on a cluster (no cluster needed)")
    plan.add_argument("file", type=Path, help="a Serve config file")
    plan.add_argument("--nodes", action="append", default=[], metavar="COUNTxGPUS[xTYPE]",
                      help="nodes to plan on, e.g. 2x8xH100 (repeatable); default: the config's cluster:")
    plan.set_defaults(func=run)


def _declared(nodes: list) -> ClusterConfig:
    """--nodes as a `cluster:` section: one group per kind of node, named after it (e.g. h100x8)."""
    groups: dict[tuple, NodeGroupConfig] = {}
    for node in nodes:
        key = (node.gpus, node.accelerator_type)
        if key in groups:
            groups[key].count += 1
        else:
            name = f"{(node.accelerator_type or 'gpu').lower()}x{node.gpus}".replace("_", "-").replace(".", "-")
            groups[key] = NodeGroupConfig(name=name, count=1, gpus_per_node=node.gpus,
                                          accelerator_type=node.accelerator_type)
    return ClusterConfig(node_groups=list(groups.values()))


def run(args: argparse.Namespace) -> int:
    from deployments.app import ClusterView, check_placement, cluster_nodes, plan_deployments
    from shunter.cli import load_app_configs
    from shunter.placement import parse_nodes

    try:
        given = parse_nodes(args.nodes)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    failed = False
    for name, cfg in load_app_configs(args.file):
        if given:  # planned as a declared cluster: a misfit is an error, as with `cluster:`
            cfg = cfg.model_copy(update={"cluster": _declared(given)})
        elif cfg.cluster is None:
            raise SystemExit(f"{args.file}: application {name!r} has no `cluster:` section; describe the nodes "
                             "with --nodes, e.g. --nodes 2x8xH100")
        nodes = cluster_nodes(cfg, ClusterView(has_gpus=True, largest_node_cpus=8))
        view = ClusterView(has_gpus=any(n.gpus for n in nodes),
                           largest_node_cpus=max((n.cpus for n in nodes), default=0) or 8, gpu_nodes=tuple(nodes))
        print(f"# application {name!r} on {len(nodes)} node(s): "
              + ", ".join(f"{n.name} ({n.gpus} {n.accelerator_type or 'GPU'})" for n in nodes))
        try:
            plan = check_placement(cfg, view)
            deployments = plan_deployments(cfg, view)
        except ConfigError as exc:
            print(str(exc))
            failed = True
            continue
        for model in cfg.models:
            for version, planned in deployments[model.name].items():
                served = model.for_version(version)
                tp, pp = served.engine.tensor_parallel_size, served.engine.pipeline_parallel_size
                label = model.name + (f" version {version}" if model.versioned else "")
                if planned["accelerator"] == "cpu":
                    print(f"{label}: CPU, {planned['cpu_cores']} core(s) per replica")
                    continue
                how = ("the replica actor holds its GPU" if tp * pp == 1 else
                       "one STRICT_PACK group per replica" if pp == 1 else
                       "stages reserved by the replica, one node each")
                print(f"{label}: GPU {model.accelerator_type or '(any type)'}, TP {tp} x PP {pp} = {tp * pp} "
                      f"GPU(s) per replica, up to {model.most_replicas} replica(s); {how}")
                for replica in (r for r in plan.replicas if r.model == model.name and r.version == version):
                    stages = ", ".join(f"stage {i + 1} -> {node}" for i, node in enumerate(replica.stage_nodes))
                    print(f"  replica {replica.replica + 1}: {stages}")
        if plan is not None:
            print("free GPUs after placement: " + ", ".join(f"{n}={g}" for n, g in plan.free_gpus.items()))
    return 1 if failed else 0
