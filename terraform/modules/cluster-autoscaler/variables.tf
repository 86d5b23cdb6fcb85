variable "cluster_name" {
  type        = string
  description = "Name of the EKS cluster whose node groups (tagged by EKS for auto-discovery) are scaled."
}

variable "region" {
  type        = string
  description = "AWS region of the cluster."
}

variable "oidc_provider_arn" {
  type        = string
  description = "ARN of the cluster's OIDC provider; the autoscaler's service account assumes its IAM role through it."
}

variable "node_selector" {
  type        = map(string)
  description = "Node selector of the autoscaler pod: the system (CPU) node group, never a GPU node it could remove."
  default     = {}
}

variable "scale_down_unneeded_time" {
  type        = string
  description = "How long a node stays unneeded (no Ray worker left on it) before it is removed."
  default     = "10m"
}

variable "tags" {
  type        = map(string)
  description = "Tags added to the IAM role and policy."
  default     = {}
}
