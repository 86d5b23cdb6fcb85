variable "cluster_name" {
  type        = string
  description = "Name of the EKS cluster; also names the VPC and prefixes the node groups' resources."
  default     = "shunter"
}

variable "kubernetes_version" {
  type        = string
  description = "EKS Kubernetes version (major.minor). The cluster autoscaler's chart must match its minor."
  default     = "1.31"
}

variable "vpc_cidr" {
  type        = string
  description = "CIDR block of the VPC. Private subnets take a /20 each (the VPC CNI gives every pod a VPC address)."
  default     = "10.0.0.0/16"
}

variable "availability_zone_suffixes" {
  type        = list(string)
  description = "Availability zones the subnets span, as letters after the region name. GPU capacity differs per zone: more zones, more chances."
  default     = ["a", "b", "c"]

  validation {
    condition     = length(var.availability_zone_suffixes) >= 2 && length(var.availability_zone_suffixes) <= 4
    error_message = "EKS needs subnets in at least two availability zones; the subnet layout has room for four."
  }
}

variable "single_nat_gateway" {
  type        = bool
  description = "One NAT gateway for the whole VPC (cheaper) instead of one per availability zone (survives a zone outage)."
  default     = true
}

variable "endpoint_public_access_cidrs" {
  type        = list(string)
  description = "CIDR blocks allowed to reach the public Kubernetes API endpoint."
  default     = ["0.0.0.0/0"]
}

variable "system_node_group" {
  type = object({
    instance_types = list(string)
    min_size       = number
    max_size       = number
    desired_size   = number
    disk_size_gib  = number
  })
  description = "The CPU node group for the operators, the Ray head (4 CPUs, 16 GiB), Prometheus and Grafana."
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
    GPU node groups by short name (the EKS node group is named gpu-<name>). `accelerator` is the value of the
    node label shunter.io/accelerator: the accelerator type Ray and the Shunter config name (H100, L4, ...),
    which the rendered RayService's GPU worker groups select. Every group runs the AL2023 NVIDIA AMI and is
    tainted nvidia.com/gpu=present:NoSchedule.
  EOT

  validation {
    condition = alltrue([
      for group in values(var.gpu_node_groups) :
      group.min_size <= group.desired_size && group.desired_size <= group.max_size && group.accelerator != ""
    ])
    error_message = "Each GPU node group needs min_size <= desired_size <= max_size and a non-empty accelerator."
  }

  validation {
    condition     = alltrue([for group in values(var.gpu_node_groups) : contains(["ON_DEMAND", "SPOT"], group.capacity_type)])
    error_message = "capacity_type is ON_DEMAND or SPOT."
  }
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every AWS resource the module creates."
  default     = {}
}
