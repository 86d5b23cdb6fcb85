variable "namespace" {
  type        = string
  description = "Namespace of the device plugin DaemonSet."
  default     = "kube-system"
}

variable "gpu_node_label" {
  type        = string
  description = "Node label (value \"true\") that marks GPU nodes; the DaemonSet runs only there."
  default     = "nvidia.com/gpu.present"
}
