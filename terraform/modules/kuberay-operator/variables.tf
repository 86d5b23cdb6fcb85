variable "namespace" {
  type        = string
  description = "Namespace of the KubeRay operator (it watches RayServices in every namespace)."
  default     = "kuberay-system"
}

variable "node_selector" {
  type        = map(string)
  description = "Node selector of the operator pod: the system (CPU) node group."
  default     = {}
}
