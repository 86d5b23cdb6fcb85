# Shunter on EKS: the cluster and its GPU node groups, the operators (cluster autoscaler, NVIDIA device
# plugin, KubeRay), monitoring with Shunter's dashboards, the RayService and a public endpoint.
# kubernetes_manifest needs a reachable cluster and installed CRDs at plan time: the first apply goes in
# three steps (see ../../README.md).

locals {
  # path.module cannot appear in a variable's default; null means these.
  rayservice_manifest_path = coalesce(var.rayservice_manifest_path, "${path.module}/../../rayservice.yaml")
  dashboards_manifest_path = coalesce(var.dashboards_manifest_path, "${path.module}/../../../ops/grafana/kubernetes/dashboards-configmaps.yaml")

  tags = merge({ project = "shunter", managed-by = "terraform" }, var.tags)

  # A short-lived token from the AWS CLI: nothing long-lived lands in the state.
  kube_exec = {
    api_version = "client.authentication.k8s.io/v1beta1"
    command     = "aws"
    args        = ["eks", "get-token", "--cluster-name", module.cluster.cluster_name, "--region", var.region]
  }
}

provider "aws" {
  region = var.region

  default_tags {
    tags = local.tags
  }
}

provider "kubernetes" {
  host                   = module.cluster.cluster_endpoint
  cluster_ca_certificate = base64decode(module.cluster.cluster_certificate_authority_data)

  exec {
    api_version = local.kube_exec.api_version
    command     = local.kube_exec.command
    args        = local.kube_exec.args
  }
}

provider "helm" {
  kubernetes {
    host                   = module.cluster.cluster_endpoint
    cluster_ca_certificate = base64decode(module.cluster.cluster_certificate_authority_data)

    exec {
      api_version = local.kube_exec.api_version
      command     = local.kube_exec.command
      args        = local.kube_exec.args
    }
  }
}

module "cluster" {
  source = "../../modules/eks-gpu-cluster"

  cluster_name                 = var.cluster_name
  kubernetes_version           = var.kubernetes_version
  vpc_cidr                     = var.vpc_cidr
  availability_zone_suffixes   = var.availability_zone_suffixes
  endpoint_public_access_cidrs = var.public_access_cidrs
  system_node_group            = var.system_node_group
  gpu_node_groups              = var.gpu_node_groups
  tags                         = local.tags
}

module "cluster_autoscaler" {
  source = "../../modules/cluster-autoscaler"

  cluster_name      = module.cluster.cluster_name
  region            = var.region
  oidc_provider_arn = module.cluster.oidc_provider_arn
  node_selector     = module.cluster.system_node_selector
  tags              = local.tags

  # Charts wait for their pods, which need the node groups up.
  depends_on = [module.cluster]
}

module "nvidia_device_plugin" {
  source = "../../modules/nvidia-device-plugin"

  depends_on = [module.cluster]
}

module "kuberay_operator" {
  source = "../../modules/kuberay-operator"

  namespace     = var.kuberay_namespace
  node_selector = module.cluster.system_node_selector

  depends_on = [module.cluster]
}

module "monitoring" {
  source = "../../modules/monitoring"

  namespace                           = var.monitoring_namespace
  shunter_namespace                   = var.shunter_namespace
  grafana_admin_password              = var.grafana_admin_password
  grafana_service_type                = var.grafana_service_type
  grafana_load_balancer_source_ranges = var.public_access_cidrs
  dashboards_manifest_path            = local.dashboards_manifest_path
  node_selector                       = module.cluster.system_node_selector

  depends_on = [module.cluster]
}

module "shunter" {
  source = "../../modules/shunter-service"

  namespace                = var.shunter_namespace
  rayservice_manifest_path = local.rayservice_manifest_path
  image                    = var.shunter_image
  public_endpoint          = true
  public_source_ranges     = var.public_access_cidrs
  hf_token                 = var.hf_token
  api_keys                 = var.api_keys
  ready_timeout            = var.rayservice_ready_timeout

  load_balancer_annotations = {
    # An NLB: its 350 s idle timeout outlasts long non-streamed generations (a classic ELB cuts at 60 s).
    "service.beta.kubernetes.io/aws-load-balancer-type" = "nlb"
  }

  # The RayService CRD comes with the operator; GPU workers need the device plugin and node autoscaling.
  depends_on = [module.kuberay_operator, module.nvidia_device_plugin, module.cluster_autoscaler]
}

data "kubernetes_service_v1" "grafana" {
  metadata {
    name      = module.monitoring.grafana_service_name
    namespace = module.monitoring.namespace
  }

  depends_on = [module.monitoring]
}
