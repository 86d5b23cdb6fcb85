output "namespace" {
  description = "Namespace of Prometheus, Grafana and the dashboard ConfigMaps."
  value       = helm_release.kube_prometheus_stack.namespace
}

output "grafana_service_name" {
  description = "Name of the Grafana Service (the chart names it <release>-grafana)."
  value       = "${helm_release.kube_prometheus_stack.name}-grafana"
}

output "prometheus_service_name" {
  description = "Name of the Prometheus Service (port 9090)."
  value       = "${helm_release.kube_prometheus_stack.name}-prometheus"
}

output "dashboard_config_maps" {
  description = "Names of the Shunter dashboard ConfigMaps applied."
  value       = keys(local.dashboards)
}

output "chart_version" {
  description = "Version of the kube-prometheus-stack chart installed."
  value       = helm_release.kube_prometheus_stack.version
}
