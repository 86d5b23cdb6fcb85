output "shunter_endpoint" {
  description = "Base URL of Shunter's OpenAI-compatible API (append /v1). Null until the load balancer has an address: apply again."
  value       = module.shunter.serve_service_address == null ? null : "http://${module.shunter.serve_service_address}:8000"
}

output "grafana_url" {
  description = "Grafana (user admin, the password you set): a hostname on AWS, an IP on Google Cloud. Null with a ClusterIP Service."
  value = try("http://${coalesce(
    data.kubernetes_service_v1.grafana.status[0].load_balancer[0].ingress[0].hostname,
    data.kubernetes_service_v1.grafana.status[0].load_balancer[0].ingress[0].ip,
  )}", null)
}

output "grafana_port_forward_command" {
  description = "Reach Grafana on http://127.0.0.1:3000 without a load balancer."
  value       = "kubectl -n ${module.monitoring.namespace} port-forward svc/${module.monitoring.grafana_service_name} 3000:80"
}

output "serve_service" {
  description = "The Service KubeRay keeps pointed at the active Ray cluster's Serve proxies, as namespace/name:port."
  value       = "${module.shunter.namespace}/${module.shunter.serve_service_name}:${module.shunter.serve_service_port}"
}

output "serve_port_forward_command" {
  description = "Reach Shunter on http://127.0.0.1:8000/v1 without the public load balancer."
  value       = module.shunter.port_forward_command
}
