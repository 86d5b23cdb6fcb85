# What runs on any GPU Kubernetes cluster, whatever the cloud: the KubeRay operator, monitoring with
# Shunter's dashboards, and the RayService behind a public load balancer. An environment (envs/*) makes
# the cluster, adds what its cloud needs for GPUs, and calls this module once.

locals {
  # path.module cannot appear in a variable's default; null means these.
  rayservice_manifest_path = coalesce(var.rayservice_manifest_path, "${path.module}/../../rayservice.yaml")
  dashboards_manifest_path = coalesce(var.dashboards_manifest_path, "${path.module}/../../../ops/grafana/kubernetes/dashboards-configmaps.yaml")
}

module "kuberay_operator" {
  source = "../kuberay-operator"

  namespace     = var.kuberay_namespace
  node_selector = var.system_node_selector
}

module "monitoring" {
  source = "../monitoring"

  namespace                           = var.monitoring_namespace
  shunter_namespace                   = var.shunter_namespace
  grafana_admin_password              = var.grafana_admin_password
  grafana_service_type                = var.grafana_service_type
  grafana_load_balancer_source_ranges = var.public_access_cidrs
  dashboards_manifest_path            = local.dashboards_manifest_path
  node_selector                       = var.system_node_selector
}

module "shunter" {
  source = "../shunter-service"

  namespace                 = var.shunter_namespace
  rayservice_manifest_path  = local.rayservice_manifest_path
  image                     = var.shunter_image
  public_endpoint           = true
  public_source_ranges      = var.public_access_cidrs
  load_balancer_annotations = var.load_balancer_annotations
  hf_token                  = var.hf_token
  api_keys                  = var.api_keys
  ready_timeout             = var.rayservice_ready_timeout

  # The RayService CRD comes with the operator.
  depends_on = [module.kuberay_operator]
}

data "kubernetes_service_v1" "grafana" {
  metadata {
    name      = module.monitoring.grafana_service_name
    namespace = module.monitoring.namespace
  }

  depends_on = [module.monitoring]
}
