"""`shunter render kuberay`: the RayService validates as Ray Serve's own deploy schema, round-trips to the
same Shunter config, and sizes its worker groups from the models."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from shunter.cli import load_app_configs
from shunter.cli import main as shunter
from shunter.config import parse_config
from shunter.kuberay import render_rayservice

ROOT = Path(__file__).resolve().parents[2]
# Configs meant for a cluster: they configure keys (local ones serve on 127.0.0.1 without keys, and
# rendering them for KubeRay, which listens on 0.0.0.0, is refused: see the test below).
CONFIGS = sorted((ROOT / "configs").glob("gpu-*.yaml"))
LOCAL_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("gpu-"))


def _render(path: Path, image: str = "registry.example/shunter:1") -> dict:
    return render_rayservice(yaml.safe_load(path.read_text()), load_app_configs(path), image)


def _groups(manifest: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_serve_config_v2_is_a_valid_serve_config_with_the_same_shunter_config(path):
    manifest = _render(path)
    serve = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)
    assert serve["http_options"]["host"] == "0.0.0.0" and serve["http_options"]["port"] == 8000
    original = yaml.safe_load(path.read_text())
    for rendered, source in zip(serve["applications"], original["applications"], strict=True):
        assert rendered["args"] == source["args"]
        assert parse_config(rendered["args"]) == parse_config(source["args"])


@pytest.mark.parametrize("path", LOCAL_CONFIGS, ids=[p.name for p in LOCAL_CONFIGS])
def test_a_keyless_config_is_not_rendered_for_a_public_endpoint_unless_it_says_anonymous(path):
    with pytest.raises(ValueError, match="no API keys on 0.0.0.0.*auth.anonymous: true"):
        _render(path)
    raw = yaml.safe_load(path.read_text())
    for app in raw["applications"]:
        app["args"]["auth"] = {"anonymous": True}
    apps = [(app["name"], parse_config(app["args"])) for app in raw["applications"]]
    assert render_rayservice(raw, apps, "img")["kind"] == "RayService"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_gpu_pods_tolerate_the_gpu_taint_and_the_head_runs_no_engine(path):
    manifest = _render(path)
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for group in cluster["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        gpus = spec["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
        tolerated = any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in spec.get("tolerations", []))
        assert tolerated == bool(gpus), group["groupName"]
        assert spec["containers"][0]["image"] == "registry.example/shunter:1"
        assert group["minReplicas"] <= group["maxReplicas"]


def test_the_405b_model_gets_two_whole_h100_nodes():
    group = _groups(_render(ROOT / "configs" / "gpu-llama-405b-tp8-pp2.yaml"))["gpu-h100-x8"]
    assert (group["minReplicas"], group["maxReplicas"]) == (2, 2)
    assert group["template"]["spec"]["nodeSelector"] == {"shunter.io/accelerator": "H100"}
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert '"accelerator_type:H100' in group["rayStartParams"]["resources"], "known before a node exists"


def test_an_autoscaled_model_spans_its_min_to_max_nodes():
    group = _groups(_render(ROOT / "configs" / "gpu-llama-8b.yaml"))["gpu-l4-x1"]
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 4)


def test_the_multi_model_config_gets_its_gpu_nodes_and_a_cpu_group_for_embeddings():
    groups = _groups(_render(ROOT / "configs" / "gpu-multi-model.yaml"))
    assert (groups["gpu-h100-x8"]["minReplicas"], groups["gpu-h100-x8"]["maxReplicas"]) == (4, 4)
    assert (groups["cpu"]["minReplicas"], groups["cpu"]["maxReplicas"]) == (2, 2)
    assert "tolerations" not in groups["cpu"]["template"]["spec"]


def test_without_a_cluster_section_pods_are_sized_by_the_largest_stage():
    raw = {"applications": [{"name": "s", "import_path": "shunter.deployments.app:build_app", "route_prefix": "/", "args": {
        "models": [{"name": "big", "source": "org/big", "accelerator_type": "A100", "replicas": 2,
                    "engine": {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}},
                   {"name": "small", "source": "org/small", "accelerator_type": "A100", "replicas": 3}],
        "auth": {"anonymous": True}}}]}
    manifest = render_rayservice(raw, [("s", parse_config(raw["applications"][0]["args"]))], "img")
    group = _groups(manifest)["gpu-a100-x4"]
    # 2 replicas x 2 stages of 4 GPUs = 4 pods; the 3 single-GPU replicas fill one more.
    assert (group["minReplicas"], group["maxReplicas"]) == (5, 5)


def test_the_cli_writes_the_manifest(tmp_path, capsys):
    out = tmp_path / "rayservice.yaml"
    assert shunter(["render", "kuberay", str(ROOT / "configs" / "gpu-llama-8b.yaml"), "-o", str(out),
                    "--image", "img:1", "--namespace", "shunter"]) == 0
    text = out.read_text()
    assert text.startswith("# Rendered by `shunter render kuberay")
    manifest = yaml.safe_load(text)
    assert manifest["kind"] == "RayService" and manifest["metadata"]["namespace"] == "shunter"
    assert "serveConfigV2: |" in text, "the Serve config stays readable in the manifest"


def test_a_config_with_key_env_keys_has_every_container_read_the_api_keys_secret():
    from shunter.kuberay import API_KEYS_SECRET

    manifest = _render(ROOT / "configs" / "gpu-llama-8b.yaml")
    cluster = manifest["spec"]["rayClusterConfig"]
    containers = [*cluster["headGroupSpec"]["template"]["spec"]["containers"],
                  *(c for g in cluster["workerGroupSpecs"] for c in g["template"]["spec"]["containers"])]
    assert len(containers) >= 2
    for container in containers:  # not optional: no Secret, no open gateway
        assert container["envFrom"] == [{"secretRef": {"name": API_KEYS_SECRET}}]
    assert "sk-" not in manifest["spec"]["serveConfigV2"]
    raw = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    raw["applications"][0]["args"]["auth"] = {"anonymous": True}  # no keys: behind an authenticating proxy
    plain = render_rayservice(raw, [("shunter", parse_config(raw["applications"][0]["args"]))], "img")
    assert "envFrom" not in str(plain)


# ---- the usage ledger's volume -----------------------------------------------------------------------------

def _small_app(usage: dict | None = None, batch: dict | None = None) -> tuple[dict, list]:
    args = {"models": [{"name": "small", "source": "org/small", "accelerator_type": "L4"}], "auth": {"anonymous": True},
            **({"usage": usage} if usage is not None else {}), **({"batch": batch} if batch is not None else {})}
    raw = {"applications": [{"name": "s", "import_path": "shunter.deployments.app:build_app", "route_prefix": "/",
                             "args": args}]}
    return raw, [("s", parse_config(args))]


def test_the_head_pod_keeps_the_usage_ledger_on_a_persistent_volume_claim():
    from shunter.kuberay import USAGE_MOUNT, usage_claim_name

    raw, apps = _small_app()
    manifest = render_rayservice(raw, apps, "img", name="prod")
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert {"mountPath": USAGE_MOUNT, "name": "usage"} in head["containers"][0]["volumeMounts"]
    assert USAGE_MOUNT == "/home/ray/.shunter", "where the default usage.path (~/.shunter/usage.sqlite3) is"
    assert {"name": "usage", "persistentVolumeClaim": {"claimName": usage_claim_name("prod")}} in head["volumes"]
    assert usage_claim_name("prod") == "prod-usage"
    assert head["securityContext"] == {"fsGroup": 100}, "the Ray image's user may write the volume"
    for group in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]:  # the ledger runs on the head only
        assert "usage" not in str(group["template"]["spec"]["volumes"])
    raw, apps = _small_app({"enabled": False, "path": "/elsewhere/u.db"}, {"enabled": False})
    plain = render_rayservice(raw, apps, "img")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert "securityContext" not in plain and len(plain["volumes"]) == 1, "no ledger and no files, no volume"
    # The Files API's state in PostgreSQL and its bytes in an object store need no volume either.
    raw, apps = _small_app({"enabled": False}, {"state": "postgresql://shunter@db:5432/shunter",
                                                "files": "s3://bucket/files"})
    plain = render_rayservice(raw, apps, "img")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert len(plain["volumes"]) == 1


@pytest.mark.parametrize("path", ["/data/usage.sqlite3", "~/usage.sqlite3", "~/.shunter/../usage.sqlite3",
                                  "~other/.shunter/usage.sqlite3", "/home/ray/.shunterx/u.db"])
def test_a_ledger_off_the_volume_is_refused(path):
    raw, apps = _small_app({"path": path})
    with pytest.raises(ValueError, match="application 's': usage.path"):
        render_rayservice(raw, apps, "img")
    for fine in ("~/.shunter/usage.sqlite3", "/home/ray/.shunter/tenants/usage.db"):
        raw, apps = _small_app({"path": fine})
        assert render_rayservice(raw, apps, "img")["kind"] == "RayService"


@pytest.mark.parametrize("batch", [{"state": "/data/batch.sqlite3"}, {"files": "~/files"}])
def test_the_files_apis_state_off_the_volume_is_refused(batch):
    raw, apps = _small_app(None, batch)
    with pytest.raises(ValueError, match=f"application 's': batch.{next(iter(batch))}"):
        render_rayservice(raw, apps, "img")


def test_the_cli_writes_the_volume_claim_beside_the_rayservice_when_asked(tmp_path):
    out = tmp_path / "rayservice.yaml"
    assert shunter(["render", "kuberay", str(ROOT / "configs" / "gpu-llama-8b.yaml"), "-o", str(out),
                    "--namespace", "ml", "--with-volume-claim", "--volume-size", "20Gi"]) == 0
    service, claim = yaml.safe_load_all(out.read_text())
    claim_name = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["volumes"][-1]
    assert claim["kind"] == "PersistentVolumeClaim" and claim["metadata"] == {
        "name": claim_name["persistentVolumeClaim"]["claimName"], "namespace": "ml",
        "labels": {"app.kubernetes.io/part-of": "shunter"}}
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "20Gi"}}}
    assert shunter(["render", "kuberay", str(ROOT / "configs" / "gpu-llama-8b.yaml"), "-o", str(out)]) == 0
    assert len(list(yaml.safe_load_all(out.read_text()))) == 1, "one document unless asked (Terraform reads one)"
