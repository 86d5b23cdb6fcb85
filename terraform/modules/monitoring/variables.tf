variable "namespace" {
  type        = string
  description = "Namespace of kube-prometheus-stack and of Shunter's dashboard ConfigMaps."
  default     = "monitoring"
}

variable "shunter_namespace" {
  type        = string
  description = "Namespace of the RayService whose Ray pods the PodMonitor scrapes."
  default     = "shunter"
}

variable "grafana_admin_password" {
  type        = string
  description = "Password of Grafana's admin user."
  sensitive   = true

  validation {
    condition     = length(var.grafana_admin_password) >= 12
    error_message = "Use a Grafana admin password of at least 12 characters: Grafana may be reachable from the internet."
  }
}

variable "grafana_service_type" {
  type        = string
  description = "Type of the Grafana Service: LoadBalancer (a URL in the outputs) or ClusterIP (kubectl port-forward)."
  default     = "LoadBalancer"

  validation {
    condition     = contains(["LoadBalancer", "ClusterIP", "NodePort"], var.grafana_service_type)
    error_message = "grafana_service_type is LoadBalancer, ClusterIP or NodePort."
  }
}

variable "grafana_load_balancer_source_ranges" {
  type        = list(string)
  description = "CIDR blocks allowed to reach Grafana's load balancer (empty: anyone)."
  default     = []
}

variable "dashboards_manifest_path" {
  type        = string
  description = "Path of the multi-document YAML of Shunter's dashboard ConfigMaps (ops/grafana/kubernetes/dashboards-configmaps.yaml)."
}

variable "node_selector" {
  type        = map(string)
  description = "Node selector of Prometheus, Grafana, Alertmanager and the operators: the system (CPU) node group."
  default     = {}
}

variable "prometheus_retention" {
  type        = string
  description = "How long Prometheus keeps samples."
  default     = "15d"
}

variable "ray_scrape_interval" {
  type        = string
  description = "How often Prometheus scrapes the Ray pods' metrics port."
  default     = "15s"
}
