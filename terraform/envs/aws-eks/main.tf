# Shunter on EKS: the cluster and its GPU node groups, what AWS needs for GPU pods (the cluster autoscaler,
# NVIDIA's device plugin), and the platform (KubeRay, monitoring with Shunter's dashboards, the RayService
# and a public endpoint).
# kubernetes_manifest needs a reachable cluster and installed CRDs at plan time: the first apply goes in
# three steps (see ../../README.md).

locals {
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

module "platform" {
  source = "../../modules/shunter-platform"

  system_node_selector = module.cluster.system_node_selector
  public_access_cidrs  = var.public_access_cidrs
  load_balancer_annotations = {
    # An NLB: its 350 s idle timeout outlasts long non-streamed generations (a classic ELB cuts at 60 s).
    "service.beta.kubernetes.io/aws-load-balancer-type" = "nlb"
  }
  shunter_namespace        = var.shunter_namespace
  kuberay_namespace        = var.kuberay_namespace
  monitoring_namespace     = var.monitoring_namespace
  rayservice_manifest_path = var.rayservice_manifest_path
  rayservice_ready_timeout = var.rayservice_ready_timeout
  dashboards_manifest_path = var.dashboards_manifest_path
  shunter_image            = var.shunter_image
  hf_token                 = var.hf_token
  api_keys                 = var.api_keys
  grafana_admin_password   = var.grafana_admin_password
  grafana_service_type     = var.grafana_service_type

  # Charts wait for their pods, which need the node groups; GPU workers need the device plugin and node autoscaling.
  depends_on = [module.cluster, module.nvidia_device_plugin, module.cluster_autoscaler]
}

# Where these lived before the platform became one module: existing state moves, nothing is recreated.
moved {
  from = module.kuberay_operator
  to   = module.platform.module.kuberay_operator
}

moved {
  from = module.monitoring
  to   = module.platform.module.monitoring
}

moved {
  from = module.shunter
  to   = module.platform.module.shunter
}
