variable "project_id" {
  type        = string
  description = "Google Cloud project the cluster lives in."
}

variable "region" {
  type        = string
  description = "Region of the cluster's control plane, network and node pools."
}

variable "zones" {
  type        = list(string)
  description = "Zones the node pools may use. Pick zones that offer your GPU types (gcloud compute accelerator-types list --filter=zone~REGION)."
}

variable "cluster_name" {
  type        = string
  description = "Name of the GKE cluster; also the prefix of its network, router and node service account."

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,20}[a-z0-9]$", var.cluster_name))
    error_message = "cluster_name: lowercase letters, digits and dashes, 2 to 22 characters, starting with a letter (it prefixes a service account id)."
  }
}

variable "kubernetes_version" {
  type        = string
  description = "Lowest Kubernetes version (major.minor) of the control plane; the REGULAR release channel upgrades it from there."
}

variable "nodes_cidr" {
  type        = string
  description = "Primary range of the nodes' subnet."
  default     = "10.10.0.0/20"
}

variable "pods_cidr" {
  type        = string
  description = "Secondary range the pods take their addresses from (VPC-native cluster)."
  default     = "10.20.0.0/14"
}

variable "services_cidr" {
  type        = string
  description = "Secondary range of the Kubernetes Services."
  default     = "10.24.0.0/20"
}

variable "master_cidr" {
  type        = string
  description = "A /28 for the control plane's private endpoint; it must not overlap the other ranges."
  default     = "172.16.0.0/28"
}

variable "api_access_cidrs" {
  type        = list(string)
  description = "CIDR blocks allowed to reach the Kubernetes API's public endpoint (master authorized networks). Terraform must run from inside them."
}

variable "system_node_pool" {
  type = object({
    machine_type = string
    min_nodes    = number
    max_nodes    = number
    disk_size_gb = number
  })
  description = "The CPU node pool (totals over its zones): operators, Prometheus, Grafana and the Ray head."
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
    zones         = optional(list(string))
  }))
  description = <<-EOT
    GPU node pools by short name (totals over the zones). gpu_type is GKE's accelerator name (nvidia-l4,
    nvidia-h100-80gb) and gpus_per_node what machine_type carries (g2-standard-8: 1, a3-highgpu-8g: 8).
    accelerator is the node label shunter.io/accelerator, the accelerator_type of the Shunter config.
    zones (null: the cluster's) must all offer gpu_type, or GKE refuses the pool.
  EOT

  validation {
    condition     = alltrue([for name, pool in var.gpu_node_pools : can(regex("^[a-z][a-z0-9-]*$", name)) && pool.min_nodes >= 0 && pool.max_nodes >= pool.min_nodes && pool.gpus_per_node > 0])
    error_message = "gpu_node_pools: names of lowercase letters, digits and dashes; 0 <= min_nodes <= max_nodes; gpus_per_node > 0."
  }
}

variable "maintenance_start_time" {
  type        = string
  description = "Start (HH:MM, UTC) of the daily 4-hour window in which GKE may upgrade the control plane and nodes. Node upgrades drain GPU nodes: pick your quietest hours."
  default     = "03:00"
}

variable "deletion_protection" {
  type        = bool
  description = "Refuse to delete the cluster (terraform destroy fails) until this is set to false and applied."
  default     = true
}

variable "labels" {
  type        = map(string)
  description = "Labels added to the cluster and its nodes."
  default     = {}
}
