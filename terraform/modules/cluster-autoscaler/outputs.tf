output "iam_role_arn" {
  description = "ARN of the IAM role the autoscaler's service account assumes."
  value       = module.irsa.iam_role_arn
}

output "chart_version" {
  description = "Version of the cluster-autoscaler chart installed."
  value       = helm_release.this.version
}
