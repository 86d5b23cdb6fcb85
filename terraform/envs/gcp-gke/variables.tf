variable "project_id" {
  type        = string
  description = "Google Cloud project to create everything in (billing enabled)."
}

variable "region" {
  type        = string
  description = "Region of the cluster. L4 (g2) and H100 (a3) capacity varies by region and zone."
  default     = "us-central1"
}

variable "zones" {
  type        = list(string)
  description = "Zones of the node pools. Pick zones that offer your GPU types: gcloud compute accelerator-types list --filter=\"zone~us-central1\"."
  default     = ["us-central1-a", "us-central1-b", "us-central1-c"]
}

variable "cluster_name" {
  type        = string
  description = "Name of the GKE cluster (and prefix of its network and node service account)."
  default     = "shunter"
}

variable "kubernetes_version" {
  type        = string
  description = "Lowest Kubernetes version (major.minor) of the control plane; the REGULAR release channel upgrades from there."
  default     = "1.31"
}

variable "system_node_pool" {
  type = object({
    machine_type = string
    min_nodes    = number
    max_nodes    = number
    disk_size_gb = number
  })
  description = "The CPU node pool, totals over its zones: KubeRay, the Ray head (4 CPUs, 16 GiB; two during an upgrade), Prometheus and Grafana."
  default = {
    machine_type = "e2-standard-8"
    min_nodes    = 2
    max_nodes    = 4
    disk_size_gb = 100
  }
}

variable "gpu_node_pools" {
  type = map(object({
    machine_type  = string
    gpu_type      = string
    gpus_per_node = number
    accelerator   = string
    min_nodes     = number
    max_nodes     = number
    disk_size_gb  = number
    spot          = optional(bool, false)
    zones         = optional(list(string)) # null: var.zones; every zone must offer gpu_type
  }))
  description = <<-EOT
    GPU node pools by short name. `accelerator` (the node label shunter.io/accelerator) must be the
    accelerator_type the Shunter config names, which the rendered RayService's GPU worker groups select.
    They start at 0 nodes: Ray's autoscaler asks for worker pods and GKE's autoscaler adds the nodes.
  EOT
  default = {
    h100 = {
      machine_type  = "a3-highgpu-8g"
      gpu_type      = "nvidia-h100-80gb"
      gpus_per_node = 8
      accelerator   = "H100"
      min_nodes     = 0
      max_nodes     = 2
      disk_size_gb  = 500
    }
    # configs/gpu-llama-8b.yaml: one L4 per replica, 8 vCPUs per node (its pods ask for 6 CPUs and 18 GiB).
    # Up to 4 replicas, and room for a second Ray cluster during an upgrade.
    l4 = {
      machine_type  = "g2-standard-8"
      gpu_type      = "nvidia-l4"
      gpus_per_node = 1
      accelerator   = "L4"
      min_nodes     = 0
      max_nodes     = 8
      disk_size_gb  = 200
    }
  }
}

variable "public_access_cidrs" {
  type        = list(string)
  description = "CIDR blocks allowed to reach the Kubernetes API, the Shunter endpoint and Grafana. Narrow it: API keys guard the endpoint, not the Kubernetes API or Grafana's login page."
  default     = ["0.0.0.0/0"]
}

variable "deletion_protection" {
  type        = bool
  description = "GKE refuses to delete the cluster while this is true: set it to false and apply before terraform destroy."
  default     = true
}

variable "maintenance_start_time" {
  type        = string
  description = "Start (HH:MM, UTC) of the daily window in which GKE may upgrade the control plane and drain nodes."
  default     = "03:00"
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

variable "labels" {
  type        = map(string)
  description = "Labels added to the cluster and its nodes."
  default     = {}
}

variable "shunter_image" {
  type        = string
  default     = null
  description = "The Ray image with Shunter installed, built from platform/Dockerfile and pushed to a registry the nodes can pull from (e.g. Artifact Registry in this project). null keeps the image named in the rendered manifest."
}
