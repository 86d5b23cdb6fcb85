# Shunter on GKE: the cluster and its GPU node pools (GKE installs the NVIDIA driver and device plugin and
# autoscales the pools itself), and the platform (KubeRay, monitoring with Shunter's dashboards, the
# RayService and a public endpoint). The same RayService rendering as on EKS runs here: both clouds label GPU nodes
# shunter.io/accelerator and taint them nvidia.com/gpu.
# kubernetes_manifest needs a reachable cluster and installed CRDs at plan time: the first apply goes in
# three steps (see ../../README.md).

locals {
  # A short-lived token from gcloud's credential plugin: nothing long-lived lands in the state.
  kube_host = "https://${module.cluster.cluster_endpoint}"
  kube_ca   = base64decode(module.cluster.cluster_ca_certificate)
  kube_exec = {
    api_version = "client.authentication.k8s.io/v1beta1"
    command     = "gke-gcloud-auth-plugin"
  }
}

provider "google" {
  project = var.project_id
  region  = var.region
}

provider "kubernetes" {
  host                   = local.kube_host
  cluster_ca_certificate = local.kube_ca

  exec {
    api_version = local.kube_exec.api_version
    command     = local.kube_exec.command
  }
}

provider "helm" {
  kubernetes {
    host                   = local.kube_host
    cluster_ca_certificate = local.kube_ca

    exec {
      api_version = local.kube_exec.api_version
      command     = local.kube_exec.command
    }
  }
}

module "cluster" {
  source = "../../modules/gke-gpu-cluster"

  project_id             = var.project_id
  region                 = var.region
  zones                  = var.zones
  cluster_name           = var.cluster_name
  kubernetes_version     = var.kubernetes_version
  api_access_cidrs       = var.public_access_cidrs
  system_node_pool       = var.system_node_pool
  gpu_node_pools         = var.gpu_node_pools
  maintenance_start_time = var.maintenance_start_time
  deletion_protection    = var.deletion_protection
  labels                 = var.labels
}

module "platform" {
  source = "../../modules/shunter-platform"

  system_node_selector      = module.cluster.system_node_selector
  public_access_cidrs       = var.public_access_cidrs
  load_balancer_annotations = {} # GKE's default: an external passthrough network load balancer, no idle timeout
  shunter_namespace         = var.shunter_namespace
  kuberay_namespace         = var.kuberay_namespace
  monitoring_namespace      = var.monitoring_namespace
  rayservice_manifest_path  = var.rayservice_manifest_path
  rayservice_ready_timeout  = var.rayservice_ready_timeout
  dashboards_manifest_path  = var.dashboards_manifest_path
  shunter_image             = var.shunter_image
  hf_token                  = var.hf_token
  api_keys                  = var.api_keys
  grafana_admin_password    = var.grafana_admin_password
  grafana_service_type      = var.grafana_service_type

  # Charts wait for their pods, which need the node pools up.
  depends_on = [module.cluster]
}
