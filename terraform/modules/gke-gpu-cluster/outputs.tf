output "cluster_name" {
  description = "Name of the GKE cluster."
  value       = google_container_cluster.this.name
}

output "cluster_endpoint" {
  description = "Address of the Kubernetes API's public endpoint (no scheme)."
  value       = google_container_cluster.this.endpoint
}

output "cluster_ca_certificate" {
  description = "Base64-encoded certificate authority of the cluster."
  value       = google_container_cluster.this.master_auth[0].cluster_ca_certificate
}

output "node_pool_names" {
  description = "GKE node pool names by key (system, gpu-<name>)."
  value       = merge({ system = google_container_node_pool.system.name }, { for key, pool in google_container_node_pool.gpu : "gpu-${key}" => pool.name })
}

output "gpu_accelerators" {
  description = "The shunter.io/accelerator label value of each GPU node pool, by pool name."
  value       = { for name, pool in var.gpu_node_pools : "gpu-${name}" => pool.accelerator }
}

output "system_node_selector" {
  description = "Node selector that places a pod on the system (CPU) node pool."
  value       = local.system_labels
}

output "gpu_taint" {
  description = "The taint every GPU node carries (API form: effect NO_SCHEDULE is NoSchedule in Kubernetes)."
  value       = local.gpu_taint
}

output "network_name" {
  description = "Name of the VPC network."
  value       = google_compute_network.this.name
}
