# The KubeRay operator turns the RayService into a Ray cluster and deploys its Serve config. The chart
# installs the CRDs on first install only: Helm never upgrades CRDs, so a chart upgrade needs them applied
# by hand first (see the README).

resource "helm_release" "this" {
  name             = "kuberay-operator"
  namespace        = var.namespace
  create_namespace = true
  repository       = "https://ray-project.github.io/kuberay-helm/"
  chart            = "kuberay-operator"
  version          = "1.3.0"

  values = [yamlencode({
    nodeSelector = var.node_selector
  })]
}
