"""Static checks of terraform/ (no cloud account here): both environments (EKS, GKE) are complete, every
file parses, variables are typed and described, providers, modules and charts are pinned, GPU nodes are
tainted and labelled and Ray's GPU pods tolerate and select them, the RayService both environments apply
is the current rendering of its config, checkov passes, and `terraform fmt` / `validate` run where a
terraform binary (and its provider registry) is reachable."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import hcl2
import pytest
import yaml

from shunter.cli import DEFAULT_IMAGE, load_app_configs
from shunter.kuberay import RAY_VERSION, manifest_yaml, render_rayservice

ROOT = Path(__file__).resolve().parents[2]
TERRAFORM = ROOT / "terraform"
TF_FILES = sorted(TERRAFORM.rglob("*.tf"))
ENVS = {"aws-eks": "eks-gpu-cluster", "gcp-gke": "gke-gpu-cluster"}  # each environment and its cluster module
RAYSERVICE = TERRAFORM / "rayservice.yaml"  # one rendering, applied by every environment
ENV_CONFIG = ROOT / "configs" / "gpu-llama-8b.yaml"
EXACT = re.compile(r"^=?\s*\d+\.\d+\.\d+$")
CHECKOV = ROOT / ".venv" / "tools" / "checkov" / "bin" / "checkov"


def _parsed(path: Path) -> dict[str, Any]:
    with path.open() as f:
        return hcl2.load(f)


def _text(value: Any) -> str:
    """python-hcl2 keeps the quotes of string literals in some versions; compare without them."""
    return str(value).strip().strip('"')


def _items(block: dict[str, Any]):
    """A parsed block's entries, without python-hcl2's own markers (`__is_block__`)."""
    return ((key, value) for key, value in block.items() if not str(key).startswith("__"))


def _blocks(kind: str) -> list[tuple[Path, str, dict[str, Any]]]:
    found = []
    for path in TF_FILES:
        for block in _parsed(path).get(kind, []):
            for name, body in _items(block):
                found.append((path, _text(name), body))
    return found


def _resources(kind: str) -> list[tuple[Path, str, dict[str, Any]]]:
    found = []
    for path in TF_FILES:
        for block in _parsed(path).get("resource", []):
            for rtype, named in _items(block):
                if _text(rtype) == kind:
                    found += [(path, _text(name), body) for name, body in _items(named)]
    return found


def _walk(node: Any):
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _modules_used(folder: Path) -> set[str]:
    """The local modules a folder calls, and the ones those call, by folder name."""
    used: set[str] = set()
    for path, _, body in _blocks("module"):
        if path.parent == folder and _text(body["source"]).startswith("."):
            called = (folder / _text(body["source"])).resolve()
            assert (called / "main.tf").exists(), f"{path.relative_to(TERRAFORM)} calls a missing module {called}"
            used |= {called.name} | _modules_used(called)
    return used


@pytest.mark.parametrize("env", sorted(ENVS))
def test_each_environment_is_complete_and_made_of_modules(env):
    path = TERRAFORM / "envs" / env
    assert (path / "main.tf").exists() and (path / "variables.tf").exists() and (path / "outputs.tf").exists()
    assert (TERRAFORM / "README.md").exists()
    used = _modules_used(path)
    assert {ENVS[env], "shunter-platform", "kuberay-operator", "monitoring", "shunter-service"} <= used, used
    outputs = {name for p, name, _ in _blocks("output") if p.parent == path}
    assert any("endpoint" in o for o in outputs) and any("grafana" in o for o in outputs), outputs
    platform = (TERRAFORM / "modules" / "shunter-platform" / "main.tf").read_text()
    assert '"${path.module}/../../rayservice.yaml"' in platform, "every environment applies the committed rendering"


@pytest.mark.parametrize("path", TF_FILES, ids=[str(p.relative_to(TERRAFORM)) for p in TF_FILES])
def test_every_file_parses(path):
    assert isinstance(_parsed(path), dict)


def test_every_variable_has_a_type_and_a_description():
    variables = _blocks("variable")
    assert variables
    missing = [f"{p.relative_to(TERRAFORM)}: {name}" for p, name, body in variables
               if "type" not in body or not _text(body.get("description", ""))]
    assert not missing, f"variables without a type or description: {missing}"


def test_providers_modules_and_charts_are_pinned_exactly():
    unpinned = []
    for path in TF_FILES:
        for block in _parsed(path).get("terraform", []):
            for providers in block.get("required_providers", []):
                for name, spec in _items(providers):
                    if not EXACT.match(_text(spec.get("version", ""))):
                        unpinned.append(f"{path.relative_to(TERRAFORM)}: provider {name} {spec.get('version')}")
    for path, name, body in _blocks("module"):
        source = _text(body.get("source", ""))
        if not source.startswith((".", "/")) and not EXACT.match(_text(body.get("version", ""))):
            unpinned.append(f"{path.relative_to(TERRAFORM)}: module {name} ({source})")
    for path, name, body in _resources("helm_release"):
        if not EXACT.match(_text(body.get("version", ""))):
            unpinned.append(f"{path.relative_to(TERRAFORM)}: helm_release {name}")
    assert not unpinned, unpinned
    assert _resources("helm_release"), "the operators come from pinned charts"


@pytest.mark.parametrize("module", sorted(ENVS.values()))
def test_gpu_nodes_are_tainted_and_labelled_by_accelerator(module):
    files = list((TERRAFORM / "modules" / module).glob("*.tf"))
    taints = [node for path in files for node in _walk(_parsed(path))
              if isinstance(node, dict) and _text(node.get("key", "")) == "nvidia.com/gpu"]
    assert any(_text(t.get("effect", "")) == "NO_SCHEDULE" for t in taints), "GPU nodes carry the taint"
    # The label is set inside a for expression on EKS, which python-hcl2 leaves as text.
    labelled = re.compile(r'"shunter\.io/accelerator"\s*=\s*[\w.]+\.accelerator\b')
    assert any(labelled.search(path.read_text()) for path in files), "GPU nodes carry the label the GPU pods select"


@pytest.mark.parametrize("env", sorted(ENVS))
def test_each_environment_has_node_pools_for_the_rendered_gpu_pods_and_advertises_their_gpus(env):
    path = TERRAFORM / "envs" / env
    (pools,) = [body["default"] for p, name, body in _blocks("variable")
                if p.parent == path and name in ("gpu_node_groups", "gpu_node_pools")]
    offered = {_text(pool["accelerator"]) for pool in pools.values()}
    manifest = yaml.safe_load(RAYSERVICE.read_text())
    wanted = {group["template"]["spec"]["nodeSelector"]["shunter.io/accelerator"]
              for group in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
              if "shunter.io/accelerator" in group["template"]["spec"].get("nodeSelector", {})}
    assert wanted and wanted <= offered, (wanted, offered)
    # EKS runs NVIDIA's device plugin chart; GKE installs the driver and its own plugin when asked to.
    cluster_module = "\n".join(f.read_text() for f in (TERRAFORM / "modules" / ENVS[env]).glob("*.tf"))
    assert "nvidia-device-plugin" in _modules_used(path) or "gpu_driver_installation_config" in cluster_module


def test_the_device_plugin_and_ray_gpu_pods_tolerate_the_gpu_taint():
    plugin = " ".join(p.read_text() for p in (TERRAFORM / "modules").rglob("*.tf") if "device" in str(p))
    assert "nvidia.com/gpu" in plugin, "the NVIDIA device plugin tolerates the GPU taint"
    manifest = yaml.safe_load(RAYSERVICE.read_text())
    for group in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        if spec["containers"][0]["resources"]["limits"].get("nvidia.com/gpu"):
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


def test_the_rayservice_terraform_applies_is_the_current_rendering_of_its_config():
    rendered = render_rayservice(yaml.safe_load(ENV_CONFIG.read_text()), load_app_configs(ENV_CONFIG), DEFAULT_IMAGE)
    committed = yaml.safe_load(RAYSERVICE.read_text())
    assert committed == rendered, ("terraform/rayservice.yaml is stale: "
                                   "make render-kuberay (shunter render kuberay configs/gpu-llama-8b.yaml -o ...)")
    assert manifest_yaml(rendered) in RAYSERVICE.read_text()


def test_the_image_carries_the_ray_version_the_manifest_names():
    dockerfile = (ROOT / "platform" / "Dockerfile").read_text()
    assert f"rayproject/ray:{RAY_VERSION}-" in dockerfile
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"ray[serve]=={RAY_VERSION}"' in pyproject
    for copied in re.findall(r"^COPY --chown=\S+ (\S+) ", dockerfile, flags=re.M):
        assert (ROOT / copied).exists(), f"the Dockerfile copies {copied}, which does not exist"


def test_checkov_passes_with_a_short_justified_skip_list():
    config = yaml.safe_load((TERRAFORM / ".checkov.yaml").read_text())
    skips = config.get("skip-check", [])
    assert len(skips) <= 12, "the skip list stays short"
    raw = (TERRAFORM / ".checkov.yaml").read_text()
    for check in skips:
        assert re.search(rf"{re.escape(check)}\s*#\s*\S", raw), f"{check} is skipped without a reason"
    binary = CHECKOV if CHECKOV.exists() else shutil.which("checkov")
    if not binary:
        pytest.skip("checkov is not installed (make test installs it into .venv/tools/checkov)")
    result = subprocess.run([str(binary), "--config-file", str(TERRAFORM / ".checkov.yaml"), "-d", str(TERRAFORM),
                             "--framework", "terraform", "--compact", "--quiet", "--download-external-modules",
                             "false"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_terraform_fmt_is_clean():
    terraform = shutil.which("terraform")
    if not terraform:
        pytest.skip("no terraform binary on PATH: fmt not checked")
    result = subprocess.run([terraform, "fmt", "-check", "-recursive", "-diff", str(TERRAFORM)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# `terraform init` fetches providers and registry modules. On a machine that cannot reach the registry
# (a sandbox without network), every error init prints is a failed call to a registry host, and validate
# cannot run: that, and only that, is a skip. Any other init failure (a module path or version that does
# not resolve, a syntax error init already sees) is a failure of the configuration.
_REGISTRY_CALL = re.compile(r"failed to request discovery document|could not connect to [\w.-]+|"
                            r"error accessing remote module registry|failed to query available provider packages|"
                            r"could not query provider registry|failed to install provider", re.I)
_NETWORK_FAILURE = re.compile(r"dial tcp|no such host|i/o timeout|connection refused|network is unreachable|"
                              r"tls handshake timeout|client\.timeout|context deadline exceeded|"
                              r"temporary failure in name resolution|connection reset by peer", re.I)


def registry_unreachable(output: str) -> str | None:
    """The registry host `terraform init` could not reach, when that is what every error it printed says;
    None when any error is something else, or it printed none."""
    errors = re.split(r"^Error: ", output, flags=re.M)[1:]
    if not errors:
        return None
    for error in errors:
        said = " ".join(error.split())
        if not (_REGISTRY_CALL.search(said) and _NETWORK_FAILURE.search(said)):
            return None
    host = re.search(r"lookup ([\w.-]+)|https://([\w.-]+)/", output)
    return (host.group(1) or host.group(2)) if host else "the registry"


# What init printed here, with no network (Terraform 1.x, -no-color), shortened.
_OFFLINE_INIT = """Initializing modules...
- cluster in ../../modules/eks-gpu-cluster

Error: Error accessing remote module registry

  on ../../modules/cluster-autoscaler/main.tf line 11:
  11: module "irsa" {

Failed to retrieve available versions for module "irsa"
(../../modules/cluster-autoscaler/main.tf:11) from registry.terraform.io:
failed to request discovery document: Get
"https://registry.terraform.io/.well-known/terraform.json": dial tcp: lookup
registry.terraform.io on 10.255.255.53:53: no such host.

Error: Failed to query available provider packages

Could not retrieve the list of available versions for provider hashicorp/aws: could not connect to
registry.terraform.io: failed to request discovery document: Get
"https://registry.terraform.io/.well-known/terraform.json": dial tcp: i/o timeout
"""
_BROKEN_INIT = """Initializing modules...

Error: Unreadable module directory

Unable to evaluate directory symlink: lstat ../../modules/no-such-module: no such file or directory
"""
_NO_SUCH_VERSION = """Error: Failed to query available provider packages

Could not retrieve the list of available versions for provider hashicorp/aws: no available releases match
the given constraints >= 99.0
"""


def test_only_an_unreachable_registry_makes_a_failed_init_a_skip():
    assert registry_unreachable(_OFFLINE_INIT) == "registry.terraform.io"
    assert registry_unreachable(_BROKEN_INIT) is None, "a missing module is the configuration's fault"
    assert registry_unreachable(_NO_SUCH_VERSION) is None, "the registry answered: no such version"
    assert registry_unreachable(_OFFLINE_INIT + "\n" + _BROKEN_INIT) is None, "one real error among outages"
    assert registry_unreachable("Terraform crashed!") is None


@pytest.mark.parametrize("env", sorted(ENVS))
def test_terraform_validate(tmp_path, env):
    terraform = shutil.which("terraform")
    if not terraform:
        pytest.skip("no terraform binary on PATH: validate not run")
    work = tmp_path / "terraform"
    shutil.copytree(TERRAFORM, work)
    shutil.copytree(ROOT / "ops" / "grafana", tmp_path / "ops" / "grafana")
    folder = work / "envs" / env
    init = subprocess.run([terraform, "init", "-backend=false", "-input=false", "-no-color"], cwd=folder,
                          capture_output=True, text=True, timeout=300)
    if init.returncode != 0:
        output = init.stdout + init.stderr
        host = registry_unreachable(output)
        if host is None:
            pytest.fail(f"terraform init failed, and not for want of a registry:\n{output[-4000:]}")
        pytest.skip(f"terraform init could not fetch providers and modules: {host} is unreachable")
    result = subprocess.run([terraform, "validate", "-no-color"], cwd=folder, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
