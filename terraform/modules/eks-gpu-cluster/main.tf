# An EKS cluster for Shunter: a VPC with private node subnets, a CPU node group for the control-plane-like
# pods (operators, Ray head, monitoring) and one managed node group per GPU kind.

data "aws_region" "current" {}

# Zones named, not discovered: the subnets stay put when AWS opens a new zone in the region.
data "aws_availability_zones" "selected" {
  state = "available"

  filter {
    name   = "zone-name"
    values = [for suffix in var.availability_zone_suffixes : "${data.aws_region.current.name}${suffix}"]
  }
}

locals {
  azs = data.aws_availability_zones.selected.names

  # Only pods that tolerate this (Ray GPU workers, the NVIDIA device plugin) land on GPU nodes, so a stray
  # CPU pod never holds an expensive node up.
  gpu_taint = {
    key    = "nvidia.com/gpu"
    value  = "present"
    effect = "NO_SCHEDULE"
  }

  system_labels = {
    "shunter.io/node-role" = "system"
  }

  system_node_group = {
    name           = "system"
    ami_type       = "AL2023_x86_64_STANDARD"
    instance_types = var.system_node_group.instance_types
    min_size       = var.system_node_group.min_size
    max_size       = var.system_node_group.max_size
    desired_size   = var.system_node_group.desired_size
    labels         = local.system_labels

    block_device_mappings = {
      xvda = {
        device_name = "/dev/xvda"
        ebs = {
          volume_size           = var.system_node_group.disk_size_gib
          volume_type           = "gp3"
          encrypted             = true
          delete_on_termination = true
        }
      }
    }
  }

  gpu_node_groups = {
    for name, group in var.gpu_node_groups : "gpu-${name}" => {
      name           = "gpu-${name}"
      ami_type       = "AL2023_x86_64_NVIDIA"
      instance_types = group.instance_types
      capacity_type  = group.capacity_type
      min_size       = group.min_size
      max_size       = group.max_size
      desired_size   = group.desired_size

      # shunter.io/accelerator is what the rendered RayService's worker groups select; nvidia.com/gpu.present
      # is what the NVIDIA device plugin's affinity looks for (no node feature discovery needed).
      labels = {
        "shunter.io/accelerator" = group.accelerator
        "nvidia.com/gpu.present" = "true"
      }

      taints = {
        gpu = local.gpu_taint
      }

      # The Ray image with vLLM is large and model weights are cached on the node's disk.
      block_device_mappings = {
        xvda = {
          device_name = "/dev/xvda"
          ebs = {
            volume_size           = group.disk_size_gib
            volume_type           = "gp3"
            throughput            = 500
            iops                  = 6000
            encrypted             = true
            delete_on_termination = true
          }
        }
      }
    }
  }
}

module "vpc" {
  source  = "terraform-aws-modules/vpc/aws"
  version = "5.16.0"

  name = var.cluster_name
  cidr = var.vpc_cidr
  azs  = local.azs

  private_subnets = [for index, az in local.azs : cidrsubnet(var.vpc_cidr, 4, index)]
  public_subnets  = [for index, az in local.azs : cidrsubnet(var.vpc_cidr, 8, 48 + index)]

  enable_nat_gateway   = true
  single_nat_gateway   = var.single_nat_gateway
  enable_dns_hostnames = true

  # Where Kubernetes places the load balancers of Services of type LoadBalancer.
  public_subnet_tags = {
    "kubernetes.io/role/elb" = "1"
  }
  private_subnet_tags = {
    "kubernetes.io/role/internal-elb" = "1"
  }

  tags = var.tags
}

module "eks" {
  source  = "terraform-aws-modules/eks/aws"
  version = "20.31.6"

  cluster_name    = var.cluster_name
  cluster_version = var.kubernetes_version

  cluster_endpoint_public_access       = true
  cluster_endpoint_public_access_cidrs = var.endpoint_public_access_cidrs

  # The identity that runs terraform administers the cluster: the kubernetes and helm providers act as it.
  enable_cluster_creator_admin_permissions = true

  cluster_addons = {
    coredns                = {}
    kube-proxy             = {}
    eks-pod-identity-agent = {}
    vpc-cni = {
      # Pods need the CNI before the first node joins.
      before_compute = true
    }
  }

  vpc_id     = module.vpc.vpc_id
  subnet_ids = module.vpc.private_subnets

  eks_managed_node_groups = merge({ system = local.system_node_group }, local.gpu_node_groups)

  tags = var.tags
}
