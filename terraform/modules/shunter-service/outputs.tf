output "name" {
  description = "Name of the RayService."
  value       = local.name
}

output "namespace" {
  description = "Namespace of the RayService."
  value       = kubernetes_namespace_v1.this.metadata[0].name
}

output "serve_service_name" {
  description = "The Service KubeRay keeps pointed at the active Ray cluster's Serve proxies (port 8000)."
  value       = "${local.name}-serve-svc"
}

output "serve_service_port" {
  description = "Port of the Serve endpoint Service."
  value       = 8000
}

output "port_forward_command" {
  description = "Reach the Serve endpoint from this machine on http://127.0.0.1:8000/v1."
  value       = "kubectl -n ${kubernetes_namespace_v1.this.metadata[0].name} port-forward svc/${local.name}-serve-svc 8000:8000"
}

output "serve_service_address" {
  description = "The load balancer address of the serve Service (public_endpoint) once the cloud has assigned it: a hostname on AWS, an IP on Google Cloud; else null."
  value = try(coalesce(
    data.kubernetes_service_v1.serve[0].status[0].load_balancer[0].ingress[0].hostname,
    data.kubernetes_service_v1.serve[0].status[0].load_balancer[0].ingress[0].ip,
  ), null)
}
