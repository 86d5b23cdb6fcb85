output "namespace" {
  description = "Namespace the operator runs in."
  value       = helm_release.this.namespace
}

output "chart_version" {
  description = "Version of the kuberay-operator chart (and so of KubeRay and its CRDs) installed."
  value       = helm_release.this.version
}
