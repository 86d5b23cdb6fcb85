output "shunter_endpoint" {
  description = "Base URL of Shunter's OpenAI-compatible API (append /v1). Null until the load balancer has an address: apply again."
  value       = module.platform.shunter_endpoint
}

output "grafana_url" {
  description = "Grafana (user admin, the password you set). Null with a ClusterIP Service: use grafana_port_forward_command."
  value       = module.platform.grafana_url
}

output "grafana_port_forward_command" {
  description = "Reach Grafana on http://127.0.0.1:3000 without a load balancer."
  value       = module.platform.grafana_port_forward_command
}

output "serve_service" {
  description = "The Service KubeRay keeps pointed at the active Ray cluster's Serve proxies, as namespace/name:port."
  value       = module.platform.serve_service
}

output "serve_port_forward_command" {
  description = "Reach Shunter on http://127.0.0.1:8000/v1 without the public load balancer."
  value       = module.platform.serve_port_forward_command
}

output "kubeconfig_command" {
  description = "Point kubectl at the cluster."
  value       = "aws eks update-kubeconfig --region ${var.region} --name ${module.cluster.cluster_name}"
}

output "cluster_name" {
  description = "Name of the EKS cluster."
  value       = module.cluster.cluster_name
}

output "cluster_endpoint" {
  description = "Endpoint of the Kubernetes API server."
  value       = module.cluster.cluster_endpoint
}

output "node_group_names" {
  description = "EKS node group names by key."
  value       = module.cluster.node_group_names
}

output "gpu_accelerators" {
  description = "The shunter.io/accelerator label of each GPU node group: what a Shunter config's accelerator_type must name."
  value       = module.cluster.gpu_accelerators
}
