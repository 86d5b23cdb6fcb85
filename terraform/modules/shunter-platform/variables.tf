variable "system_node_selector" {
  type        = map(string)
  description = "Node selector of the system (CPU) nodes: the KubeRay operator, Prometheus and Grafana run there."
}

variable "public_access_cidrs" {
  type        = list(string)
  description = "CIDR blocks allowed to reach the Shunter endpoint and Grafana's load balancer."
}

variable "load_balancer_annotations" {
  type        = map(string)
  description = "Annotations of the public serve Service that choose the cloud's load balancer (see shunter-service)."
  default     = {}
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

variable "shunter_image" {
  type        = string
  description = "The Ray image with Shunter installed (platform/Dockerfile) for every Ray container; null keeps the rendered manifest's image."
  default     = null
}

variable "hf_token" {
  type        = string
  description = "Hugging Face token for gated models, in a Secret the Ray containers read as HF_TOKEN; null: no Secret."
  default     = null
  sensitive   = true
}

variable "api_keys" {
  type        = map(string)
  description = "API keys by the environment variable the config names, in the Secret shunter-api-keys that every Ray container reads."
  default     = {}
  sensitive   = true
}

variable "grafana_admin_password" {
  type        = string
  description = "Password of Grafana's admin user (at least 12 characters)."
  sensitive   = true
}

variable "grafana_service_type" {
  type        = string
  description = "Type of the Grafana Service: LoadBalancer (grafana_url output) or ClusterIP (port-forward)."
  default     = "LoadBalancer"
}
