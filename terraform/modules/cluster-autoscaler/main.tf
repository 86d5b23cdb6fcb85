# Ray's autoscaler adds and removes worker pods; the cluster autoscaler adds and removes the nodes they need.
# Without it a GPU node group at 0 nodes never grows. Scale-from-zero works with managed node groups: the
# autoscaler reads their labels and taints from the EKS API (eks:DescribeNodegroup) and knows each instance
# type's GPU count.

locals {
  service_account = "cluster-autoscaler"
  namespace       = "kube-system"
}

module "irsa" {
  source  = "terraform-aws-modules/iam/aws//modules/iam-role-for-service-accounts-eks"
  version = "5.48.0"

  role_name                        = "${var.cluster_name}-cluster-autoscaler"
  attach_cluster_autoscaler_policy = true
  cluster_autoscaler_cluster_names = [var.cluster_name]

  oidc_providers = {
    main = {
      provider_arn               = var.oidc_provider_arn
      namespace_service_accounts = ["${local.namespace}:${local.service_account}"]
    }
  }

  tags = var.tags
}

resource "helm_release" "this" {
  name       = "cluster-autoscaler"
  namespace  = local.namespace
  repository = "https://kubernetes.github.io/autoscaler"
  chart      = "cluster-autoscaler"
  # 9.43.x runs cluster-autoscaler 1.31, the minor of the cluster's Kubernetes.
  version = "9.43.1"

  values = [yamlencode({
    fullnameOverride = "cluster-autoscaler"
    cloudProvider    = "aws"
    awsRegion        = var.region
    autoDiscovery = {
      clusterName = var.cluster_name
    }
    rbac = {
      serviceAccount = {
        create = true
        name   = local.service_account
        annotations = {
          "eks.amazonaws.com/role-arn" = module.irsa.iam_role_arn
        }
      }
    }
    nodeSelector = var.node_selector
    extraArgs = {
      expander                      = "least-waste"
      "balance-similar-node-groups" = true
      "skip-nodes-with-system-pods" = false
      # The Ray head keeps its state in emptyDir volumes: never drain its node to save one.
      "skip-nodes-with-local-storage" = true
      "scale-down-unneeded-time"      = var.scale_down_unneeded_time
    }
  })]
}
