"""A KubeRay RayService manifest from a Shunter Serve config (`shunter render kuberay FILE`).

The Serve config goes into `serveConfigV2` unchanged but for what Kubernetes needs (the proxy listens on
0.0.0.0:8000 on every node, where KubeRay's serve service points; with direct ingress, the default, that
proxy is Serve's HAProxy and every pod's env says so: `shunter.ingress`). The Ray cluster beside it is sized from
the models: each GPU worker group is one kind of node (the config's `cluster.node_groups`, or, without
one, a pod per accelerator type as large as its largest tensor-parallel stage); its maxReplicas are the
nodes the planner fills with every model at its most replicas (a rollout's two versions included), its
minReplicas those it fills at the fewest replicas. GPU pods tolerate the GPU taint and select their
accelerator label; the head does no model work (num-cpus 0). The head pod mounts a PersistentVolumeClaim at
/home/ray/.shunter for the usage ledger (usage.path must be there: the render refuses a path off it). Pure:
tested without a cluster.
"""

from __future__ import annotations

import copy
import json
import math
import posixpath
from typing import Any

from shunter.auth import open_public_bind
from shunter.cluster_quiet import quiet_env
from shunter.config import ShunterConfig
from shunter.ingress import cluster_env
from shunter.placement import NodeSpec, ReplicaDemand, declared_nodes, plan_cluster, replica_demands

RAY_VERSION = "2.60.0"
SERVE_PORT = 8000
METRICS_PORT = 8080  # Ray's metrics export port; the PodMonitor scrapes the port named `metrics`
GPU_TAINT_KEY = "nvidia.com/gpu"
ACCELERATOR_LABEL = "shunter.io/accelerator"  # set on GPU nodes by terraform/modules/{eks,gke}-gpu-cluster
DEFAULT_CPU_POD_CORES = 8
# Every Ray container reads this Secret's entries as environment variables (entry name = variable name),
# so a config's `key_env` keys come from it; created by terraform/modules/shunter-service or kubectl.
API_KEYS_SECRET = "shunter-api-keys"
# The usage ledger (usage.path, default ~/.shunter/usage.sqlite3) lives on the head node: the head pod mounts
# a PersistentVolumeClaim here so it outlives the pod. The claim is made beside the RayService (Terraform's
# shunter-service module, or `shunter render kuberay --with-volume-claim`).
RAY_HOME = "/home/ray"  # the Ray image's user `ray`: `~` on every pod
USAGE_MOUNT = f"{RAY_HOME}/.shunter"
RAY_USERS_GID = 100  # the Ray image's group `users`: the volume is made writable for it (fsGroup)
DEFAULT_USAGE_VOLUME_SIZE = "10Gi"


def render_rayservice(serve_config: dict[str, Any], apps: list[tuple[str, ShunterConfig]], image: str,
                      name: str = "shunter", namespace: str | None = None) -> dict[str, Any]:
    """The RayService for `serve_config` (a whole Serve config file, already validated) and its parsed
    Shunter apps."""
    serve = copy.deepcopy(serve_config)
    serve["proxy_location"] = "EveryNode"
    serve["http_options"] = {**serve.get("http_options", {}), "host": "0.0.0.0", "port": SERVE_PORT}
    for app_name, cfg in apps:  # the gateway would refuse to start; say so before anything is applied
        refusal = open_public_bind("0.0.0.0", cfg.auth)
        if refusal is not None:
            raise ValueError(f"application {app_name!r}: {refusal} (KubeRay's serve service listens on 0.0.0.0)")
    # What must live on the head pod's volume: the usage ledger's file, and the Files API's state and bytes
    # where they are on the head node (not in PostgreSQL or an object store).
    on_volume = [(app_name, field, path) for app_name, cfg in apps for field, path in _head_node_paths(cfg)]
    for app_name, field, path in on_volume:
        problem = _off_the_volume(path, field)
        if problem is not None:
            raise ValueError(f"application {app_name!r}: {problem}")
    groups = _worker_groups([cfg for _, cfg in apps], image)
    head = _container("ray-head", image, cpus=4, memory_gib=16, head=True)
    head_spec: dict[str, Any] = {}
    if on_volume:
        head["volumeMounts"].append({"mountPath": USAGE_MOUNT, "name": "usage"})
        head_spec = {"securityContext": {"fsGroup": RAY_USERS_GID},
                     "volumes": [{"name": "usage", "persistentVolumeClaim": {"claimName": usage_claim_name(name)}}]}
    if any(cfg.auth.env_vars for _, cfg in apps):
        # The gateway may run on any node: every container gets the keys. Not optional: a missing Secret
        # holds the pods back with a clear event rather than starting an open gateway.
        for container in [head, *(c for group in groups for c in group["template"]["spec"]["containers"])]:
            container["envFrom"] = [{"secretRef": {"name": API_KEYS_SECRET}}]
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/part-of": "shunter"}}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": metadata,
        "spec": {
            "serveConfigV2": _yaml(serve),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 600},
                "headGroupSpec": {
                    # No engine on the head: it keeps the GCS, the Serve controller and a proxy.
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0",
                                       "metrics-export-port": str(METRICS_PORT)},
                    "template": _pod(head, **head_spec),
                },
                "workerGroupSpecs": groups,
            },
        },
    }


def _worker_groups(configs: list[ShunterConfig], image: str) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = []
    gpu_nodes: list[NodeSpec] = []
    most: list[ReplicaDemand] = []
    least: list[ReplicaDemand] = []
    cpu_pods = {"most": 0, "least": 0, "cores": 0}
    for cfg in configs:
        accelerators = {m.name: _accelerator(m.accelerator, cfg) for m in cfg.models}
        most += replica_demands(cfg, accelerators)
        least += replica_demands(cfg, accelerators, least=True)
        if cfg.cluster:
            gpu_nodes += [n for n in declared_nodes(cfg.cluster) if n.gpus > 0]
        for model in cfg.models:
            if accelerators[model.name] == "cpu":
                cores = model.cpu_cores_per_replica if isinstance(model.cpu_cores_per_replica, int) \
                    else DEFAULT_CPU_POD_CORES
                cpu_pods["cores"] = max(cpu_pods["cores"], cores)
                cpu_pods["most"] += model.most_replicas * model.most_running_versions
                cpu_pods["least"] += model.fewest_replicas
    if most:
        if not gpu_nodes:
            gpu_nodes = _nodes_per_type(most)
        used_most = _nodes_used(most, gpu_nodes)
        used_least = _nodes_used(least, gpu_nodes)
        for kind, nodes in _kinds(gpu_nodes).items():
            gpus, accel = kind
            names = {n.name for n in nodes}
            groups.append(_gpu_group(accel, gpus, nodes[0].cpus, image,
                                     least=len(names & used_least), most=len(names & used_most)))
    if cpu_pods["most"]:
        groups.append({
            "groupName": "cpu",
            "replicas": cpu_pods["least"], "minReplicas": cpu_pods["least"], "maxReplicas": cpu_pods["most"],
            "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
            "template": _pod(_container("ray-worker", image, cpus=cpu_pods["cores"], memory_gib=4 * cpu_pods["cores"])),
        })
    return groups


def _accelerator(accelerator: str, cfg: ShunterConfig) -> str:
    """`auto` on Kubernetes: GPU when the config plans GPU nodes (or, without a plan, always: a cluster
    rendered for KubeRay is the GPU cluster)."""
    if accelerator != "auto":
        return accelerator
    if cfg.cluster is None:
        return "gpu"
    return "gpu" if any(g.gpus_per_node > 0 for g in cfg.cluster.node_groups) else "cpu"


def _nodes_per_type(demands: list[ReplicaDemand]) -> list[NodeSpec]:
    """Without `cluster:`, one pod kind per accelerator type, as large as its largest stage, and enough
    of them for every demand."""
    nodes = []
    for accel in sorted({d.layout.accelerator_type or "" for d in demands}):
        mine = [d for d in demands if (d.layout.accelerator_type or "") == accel]
        gpus = max(d.layout.tensor_parallel for d in mine)
        count = sum(d.count * d.layout.pipeline_parallel * math.ceil(d.layout.tensor_parallel / gpus) for d in mine)
        label = accel or "gpu"
        nodes += [NodeSpec(f"{label.lower()}x{gpus}-{i}", gpus, 0, accel or None) for i in range(count)]
    return nodes


def _nodes_used(demands: list[ReplicaDemand], nodes: list[NodeSpec]) -> set[str]:
    if not demands:
        return set()
    plan = plan_cluster(demands, nodes)
    return {node for replica in plan.replicas for node in replica.stage_nodes}


def _kinds(nodes: list[NodeSpec]) -> dict[tuple[int, str | None], list[NodeSpec]]:
    kinds: dict[tuple[int, str | None], list[NodeSpec]] = {}
    for node in nodes:
        kinds.setdefault((node.gpus, node.accelerator_type), []).append(node)
    return kinds


def _gpu_group(accel: str | None, gpus: int, cpus: int, image: str, least: int, most: int) -> dict[str, Any]:
    params: dict[str, Any] = {"metrics-export-port": str(METRICS_PORT)}
    # A pod is a whole node: all its GPUs, its CPUs less two for the kubelet and daemonsets (8 per GPU
    # when the node is not described), 3 GiB of host memory per CPU (GPU instances have 4 or more).
    pod_cpus = max(1, cpus - 2) if cpus else 8 * gpus
    container = _container("ray-worker", image, cpus=pod_cpus, memory_gib=3 * pod_cpus, gpus=gpus)
    template = _pod(container, tolerations=[{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}])
    spec = template["spec"]
    if accel:
        # The autoscaler must know a group provides the type before any of its nodes exists (scale from
        # zero); Ray detects it on real GPUs as well.
        params["resources"] = json.dumps(json.dumps({f"accelerator_type:{accel}": 1}))  # KubeRay's quoting
        spec["nodeSelector"] = {ACCELERATOR_LABEL: accel}
    name = f"gpu-{(accel or 'any').lower()}-x{gpus}".replace("_", "-").replace(".", "-")
    return {"groupName": name, "replicas": least, "minReplicas": least, "maxReplicas": max(most, least),
            "rayStartParams": params, "template": template}


def _container(name: str, image: str, cpus: int, memory_gib: int, gpus: int = 0, head: bool = False) -> dict[str, Any]:
    limits: dict[str, Any] = {"cpu": str(cpus), "memory": f"{memory_gib}Gi"}
    if gpus:
        limits[GPU_TAINT_KEY] = str(gpus)
    ports = [{"containerPort": METRICS_PORT, "name": "metrics"}]
    if head:
        ports = [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
                 {"containerPort": 10001, "name": "client"}, {"containerPort": SERVE_PORT, "name": "serve"}, *ports]
    # Every Ray process reads Serve's ingress and pacing variables: the same on every pod (shunter.ingress,
    # shunter.cluster_quiet).
    env = [{"name": k, "value": v} for k, v in {**quiet_env(), **cluster_env()}.items()]
    return {
        "name": name, "image": image, "ports": ports, **({"env": env} if env else {}),
        "resources": {"limits": limits, "requests": dict(limits)},
        # Ray's sessions and vLLM's shared-memory transfers need more than the container default.
        "volumeMounts": [{"mountPath": "/dev/shm", "name": "dshm"}],
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
    }


def _pod(container: dict[str, Any], volumes: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    return {"spec": {"containers": [container],
                     "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, *(volumes or [])], **spec}}


def usage_claim_name(name: str) -> str:
    """The PersistentVolumeClaim the head pod of RayService `name` keeps its usage ledger on."""
    return f"{name}-usage"


def _head_node_paths(cfg: ShunterConfig) -> list[tuple[str, str]]:
    """(field, path) of what an app keeps in files on the head node."""
    paths = [("usage.path", cfg.usage.path)] if cfg.usage.enabled else []
    if cfg.batch.enabled:
        if "://" not in cfg.batch.state:
            paths.append(("batch.state", cfg.batch.state))
        if "://" not in cfg.batch.files:
            paths.append(("batch.files", cfg.batch.files))
    return paths


def _off_the_volume(path: str, field: str = "usage.path") -> str | None:
    """Why `field`'s path would not be on the head pod's persistent volume (None: it is). Refused rather than
    warned about: a ledger (or the Files API's state) off the volume is lost with the pod, silently, which is
    what it exists to prevent."""
    if path.startswith("~") and not (path == "~" or path.startswith("~/")):
        return f"{field} {path!r}: only `~` (the ray user's home) can be resolved here, not another user's"
    where = posixpath.normpath(RAY_HOME + path[1:] if path.startswith("~") else path)
    if not where.startswith(USAGE_MOUNT + "/"):
        switch = "usage.enabled" if field.startswith("usage") else "batch.enabled"
        return (f"{field} {path!r} is not on the persistent volume the head pod mounts at {USAGE_MOUNT} (~/.shunter): "
                f"it would be lost with the pod; put it under ~/.shunter/ or set {switch}: false")
    return None


def usage_volume_claim(name: str, namespace: str | None = None, size: str = DEFAULT_USAGE_VOLUME_SIZE,
                       storage_class: str | None = None) -> dict[str, Any]:
    """The PersistentVolumeClaim of RayService `name`'s usage ledger (one writer: the head pod)."""
    metadata: dict[str, Any] = {"name": usage_claim_name(name), "labels": {"app.kubernetes.io/part-of": "shunter"}}
    if namespace:
        metadata["namespace"] = namespace
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata, "spec": spec}


def _yaml(data: Any) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def manifest_yaml(manifest: dict[str, Any]) -> str:
    """The manifest as YAML, with serveConfigV2 as a block a person can read and diff."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump(manifest, Dumper=Dumper, sort_keys=False)
