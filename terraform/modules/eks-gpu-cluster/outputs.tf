output "cluster_name" {
  description = "Name of the EKS cluster."
  value       = module.eks.cluster_name
}

output "cluster_endpoint" {
  description = "Endpoint of the Kubernetes API server."
  value       = module.eks.cluster_endpoint
}

output "cluster_certificate_authority_data" {
  description = "Base64-encoded certificate authority data of the cluster."
  value       = module.eks.cluster_certificate_authority_data
}

output "oidc_provider_arn" {
  description = "ARN of the cluster's OIDC provider, for IAM roles for service accounts."
  value       = module.eks.oidc_provider_arn
}

output "node_group_names" {
  description = "EKS node group names by key (system, gpu-<name>); EKS adds a suffix to each."
  # node_group_id is "<cluster name>:<node group name>".
  value = { for key, group in module.eks.eks_managed_node_groups : key => element(split(":", group.node_group_id), 1) }
}

output "gpu_accelerators" {
  description = "The shunter.io/accelerator label value of each GPU node group, by key."
  value       = { for name, group in var.gpu_node_groups : "gpu-${name}" => group.accelerator }
}

output "system_node_selector" {
  description = "Node selector that places a pod on the system (CPU) node group."
  value       = local.system_labels
}

output "gpu_taint" {
  description = "The taint every GPU node carries (EKS API form: effect NO_SCHEDULE is NoSchedule in Kubernetes)."
  value       = local.gpu_taint
}

output "vpc_id" {
  description = "ID of the VPC."
  value       = module.vpc.vpc_id
}

output "private_subnet_ids" {
  description = "IDs of the private subnets the nodes run in."
  value       = module.vpc.private_subnets
}
