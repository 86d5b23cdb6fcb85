variable "region" {
  type        = string
  description = "AWS region. p5 (H100) and g6 (L4) capacity varies by region and zone."
  default     = "us-west-2"
}

variable "cluster_name" {
  type        = string
  description = "Name of the EKS cluster."
  default     = "shunter"
}

variable "kubernetes_version" {
  type        = string
  description = "EKS Kubernetes version (major.minor); the cluster autoscaler chart is pinned for 1.31."
  default     = "1.31"
}

variable "vpc_cidr" {
  type        = string
  description = "CIDR block of the VPC."
  default     = "10.0.0.0/16"
}

variable "availability_zone_suffixes" {
  type        = list(string)
  description = "Availability zones of the subnets, as letters after the region name. Pick zones that offer your GPU instance types."
  default     = ["a", "b", "c"]
}

variable "system_node_group" {
  type = object({
    instance_types = list(string)
    min_size       = number
    max_size       = number
    desired_size   = number
    disk_size_gib  = number
  })
  description = "The CPU node group: KubeRay, the cluster autoscaler, the Ray head (4 CPUs, 16 GiB; two during an upgrade), Prometheus and Grafana."
  default = {
    instance_types = ["m6i.2xlarge"]
    min_size       = 2
    max_size       = 4
    desired_size   = 2
    disk_size_gib  = 100
  }
}

variable "gpu_node_groups" {
  type = map(object({
    instance_types = list(string)
    accelerator    = string
    min_size       = number
    max_size       = number
    desired_size   = number
    disk_size_gib  = number
    capacity_type  = optional(string, "ON_DEMAND")
  }))
  description = <<-EOT
    GPU node groups by short name. `accelerator` (the node label shunter.io/accelerator) must be the
    accelerator_type the Shunter config names, which the rendered RayService's GPU worker groups select.
    They start at 0 nodes: Ray's autoscaler asks for worker pods and the cluster autoscaler adds the nodes.
  EOT
  default = {
    h100 = {
      instance_types = ["p5.48xlarge"]
      accelerator    = "H100"
      min_size       = 0
      max_size       = 2
      desired_size   = 0
      disk_size_gib  = 500
    }
    # configs/gpu-llama-8b.yaml: one L4 per replica, 8 vCPUs per node (its pods ask for 6 CPUs and 18 GiB,
    # more than a g6.xlarge has). Up to 4 replicas, and room for a second Ray cluster during an upgrade.
    l4 = {
      instance_types = ["g6.2xlarge"]
      accelerator    = "L4"
      min_size       = 0
      max_size       = 8
      desired_size   = 0
      disk_size_gib  = 200
    }
  }
}

variable "public_access_cidrs" {
  type        = list(string)
  description = "CIDR blocks allowed to reach the Kubernetes API, the Shunter endpoint and Grafana. Narrow it: API keys guard the endpoint, not the Kubernetes API or Grafana's login page."
  default     = ["0.0.0.0/0"]
}

variable "shunter_namespace" {
  type        = string
  description = "Namespace of the RayService."
  default     = "shunter"
}

variable "kuberay_namespace" {
  type        = string
  description = "Namespace of the KubeRay operator."
  default     = "kuberay-system"
}

variable "monitoring_namespace" {
  type        = string
  description = "Namespace of Prometheus, Grafana and Shunter's dashboards."
  default     = "monitoring"
}

variable "rayservice_manifest_path" {
  type        = string
  description = "RayService manifest rendered by `shunter render kuberay` (null: terraform/rayservice.yaml, the rendering of configs/gpu-llama-8b.yaml)."
  default     = null
}

variable "rayservice_ready_timeout" {
  type        = string
  description = "How long an apply waits for the RayService's Ready condition (GPU nodes start, the image is pulled, models load)."
  default     = "45m"
}

variable "dashboards_manifest_path" {
  type        = string
  description = "Shunter's dashboard ConfigMaps (null: ops/grafana/kubernetes/dashboards-configmaps.yaml of this repository)."
  default     = null
}

variable "hf_token" {
  type        = string
  description = "Hugging Face token for gated models such as Llama 3.1 (a Secret the Ray containers read as HF_TOKEN). Pass it as TF_VAR_hf_token; null: no Secret."
  default     = null
  sensitive   = true
}

variable "api_keys" {
  type        = map(string)
  description = "API keys by the environment variable the config names (configs/gpu-llama-8b.yaml: SHUNTER_KEY_DEFAULT and SHUNTER_ADMIN_KEY). Pass them as TF_VAR_api_keys='{SHUNTER_KEY_DEFAULT=\"...\",SHUNTER_ADMIN_KEY=\"...\"}'; make keys with `shunter keys new`."
  default     = {}
  sensitive   = true
}

variable "grafana_admin_password" {
  type        = string
  description = "Password of Grafana's admin user (at least 12 characters). Pass it as TF_VAR_grafana_admin_password."
  sensitive   = true
}

variable "grafana_service_type" {
  type        = string
  description = "Type of the Grafana Service: LoadBalancer (grafana_url output) or ClusterIP (port-forward)."
  default     = "LoadBalancer"
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every AWS resource."
  default     = {}
}

variable "shunter_image" {
  type        = string
  default     = null
  description = "The Ray image with Shunter installed, built from platform/Dockerfile and pushed to a registry the nodes can pull from (e.g. ECR). null keeps the image named in rayservice.yaml."
}
