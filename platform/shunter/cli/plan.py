"""`shunter plan FILE [--nodes 2x8xH100 ...]`: where every replica's devices would go, before deploying.

Runs the same checks the app builder runs at deploy time (model split, engine settings, capacity) against
the nodes given on the command line, or the config's `cluster:` section, and prints each replica's
pipeline stages with the node that holds them. A config with neither and no GPU model is planned on this
machine, as `serve run` would run it: its CPU engines' cores against this machine's. Exits 1 with the
problems when the config cannot be served. `shunter config check` runs the same planning (`check_builds`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from shunter.config import ClusterConfig, ConfigError, NodeGroupConfig

if TYPE_CHECKING:
    from shunter.config import ShunterConfig
    from shunter.serve_plan import ClusterView


def add_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="where each replica's GPUs (or CPU cores) would go (no cluster needed)")
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


def planning_view(cfg: ShunterConfig) -> ClusterView:
    """The cluster a config is planned on before deploying: its `cluster:` section, else this machine."""
    from shunter.placement import declared_nodes
    from shunter.serve_plan import ClusterView

    if cfg.cluster is None:
        return ClusterView.detect()  # no Ray cluster in this process: this machine's cores, no GPU
    nodes = declared_nodes(cfg.cluster)
    return ClusterView(has_gpus=any(n.gpus for n in nodes),
                       largest_node_cpus=max((n.cpus for n in nodes), default=0) or 8, gpu_nodes=tuple(nodes))


def check_builds(path: Path, name: str, cfg: ShunterConfig) -> None:
    """What `build_app` would refuse (engine splits, GPU placement, CPU cores), planned on `planning_view`;
    raises SystemExit with the builder's message."""
    from shunter.deployments.app import deployment_options

    try:
        deployment_options(cfg, planning_view(cfg))  # the plan and the Serve options (a custom router's path)
    except ConfigError as exc:
        raise SystemExit(f"{path}: application {name!r}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from shunter.cli.app_files import load_app_configs
    from shunter.placement import parse_nodes
    from shunter.serve_plan import check_placement, cpu_core_demands, plan_deployments

    try:
        given = parse_nodes(args.nodes)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    failed = False
    for name, cfg in load_app_configs(args.file):
        if given:  # planned as a declared cluster: a misfit is an error, as with `cluster:`
            cfg = cfg.model_copy(update={"cluster": _declared(given)})
        elif cfg.cluster is None and any(m.accelerator == "gpu" for m in cfg.models):
            raise SystemExit(f"{args.file}: application {name!r} has no `cluster:` section; describe the nodes "
                             "with --nodes, e.g. --nodes 2x8xH100")
        view = planning_view(cfg)
        if cfg.cluster is None:
            print(f"# application {name!r} on {view.cpu_node}: {view.largest_node_cpus} CPU core(s), no GPU "
                  "(for a GPU cluster: --nodes or `cluster:`)")
        else:
            print(f"# application {name!r} on {len(view.gpu_nodes)} node(s): "
                  + ", ".join(f"{n.name} ({n.gpus} {n.accelerator_type or 'GPU'})" for n in view.gpu_nodes))
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
                    cores = planned["cpu_cores"]
                    owns = f"{cores} core(s) per replica" if cores else "shared cores (owns none)"
                    print(f"{label}: CPU, {owns}")
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
        demands = cpu_core_demands(cfg, deployments)
        if demands and cfg.cluster is None:
            print(f"CPU cores: {sum(d.cores * d.start for d in demands)} of {view.cpu_node}'s "
                  f"{view.largest_node_cpus} at start, up to {sum(d.cores * d.most for d in demands)} scaled out "
                  "or during a rollout")
    return 1 if failed else 0
