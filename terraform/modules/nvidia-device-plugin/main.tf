# The NVIDIA device plugin advertises each node's GPUs as the nvidia.com/gpu resource. The AL2023 NVIDIA AMI
# ships the driver and the container toolkit, not the plugin.

resource "helm_release" "this" {
  name       = "nvidia-device-plugin"
  namespace  = var.namespace
  repository = "https://nvidia.github.io/k8s-device-plugin"
  chart      = "nvidia-device-plugin"
  version    = "0.17.0"

  values = [yamlencode({
    # GPU nodes carry the nvidia.com/gpu taint; the plugin must run there all the same.
    tolerations = [
      {
        key      = "nvidia.com/gpu"
        operator = "Exists"
        effect   = "NoSchedule"
      },
      {
        key      = "CriticalAddonsOnly"
        operator = "Exists"
      },
    ]
    # The node groups label GPU nodes themselves, so no node feature discovery is installed to find them.
    affinity = {
      nodeAffinity = {
        requiredDuringSchedulingIgnoredDuringExecution = {
          nodeSelectorTerms = [
            {
              matchExpressions = [
                {
                  key      = var.gpu_node_label
                  operator = "In"
                  values   = ["true"]
                },
              ]
            },
          ]
        }
      }
    }
  })]
}
