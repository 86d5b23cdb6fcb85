# Prometheus and Grafana (kube-prometheus-stack), Shunter's dashboards as ConfigMaps the Grafana sidecar
# loads, and a PodMonitor that scrapes every Ray pod's metrics export port.

locals {
  # The file is several YAML documents; the first is only a comment and decodes to null.
  dashboard_documents = [
    for doc in split("\n---\n", file(var.dashboards_manifest_path)) : yamldecode(doc)
    if trimspace(doc) != "" && can(yamldecode(doc).metadata.name)
  ]
  dashboards = { for doc in local.dashboard_documents : doc.metadata.name => doc }
}

resource "helm_release" "kube_prometheus_stack" {
  name             = "kube-prometheus-stack"
  namespace        = var.namespace
  create_namespace = true
  repository       = "https://prometheus-community.github.io/helm-charts"
  chart            = "kube-prometheus-stack"
  version          = "66.3.1"
  timeout          = 900

  values = [yamlencode({
    prometheusOperator = {
      nodeSelector = var.node_selector
    }
    prometheus = {
      prometheusSpec = {
        # Select PodMonitors and ServiceMonitors from every namespace, not only those labelled for this release.
        podMonitorSelectorNilUsesHelmValues     = false
        serviceMonitorSelectorNilUsesHelmValues = false
        retention                               = var.prometheus_retention
        nodeSelector                            = var.node_selector
      }
    }
    alertmanager = {
      alertmanagerSpec = {
        nodeSelector = var.node_selector
      }
    }
    kube-state-metrics = {
      nodeSelector = var.node_selector
    }
    grafana = {
      nodeSelector = var.node_selector
      service = {
        type = var.grafana_service_type
        # An empty list leaves the load balancer open; the chart omits the field then.
        loadBalancerSourceRanges = var.grafana_load_balancer_source_ranges
      }
      sidecar = {
        dashboards = {
          enabled          = true
          label            = "grafana_dashboard"
          labelValue       = "1"
          folderAnnotation = "grafana_folder"
          searchNamespace  = "ALL"
          provider = {
            # The grafana_folder annotation files Shunter's dashboards under a Shunter folder.
            foldersFromFilesStructure = true
          }
        }
      }
    }
  })]

  set_sensitive {
    name  = "grafana.adminPassword"
    value = var.grafana_admin_password
  }
}

resource "kubernetes_manifest" "dashboard" {
  for_each = local.dashboards

  manifest = merge(each.value, {
    metadata = merge(each.value.metadata, { namespace = var.namespace })
  })

  depends_on = [helm_release.kube_prometheus_stack]
}

resource "kubernetes_manifest" "ray_pod_monitor" {
  manifest = {
    apiVersion = "monitoring.coreos.com/v1"
    kind       = "PodMonitor"
    metadata = {
      name      = "ray"
      namespace = var.namespace
      labels = {
        "app.kubernetes.io/part-of" = "shunter"
      }
    }
    spec = {
      namespaceSelector = {
        matchNames = [var.shunter_namespace]
      }
      # KubeRay labels every pod of a Ray cluster with its node type.
      selector = {
        matchExpressions = [
          {
            key      = "ray.io/node-type"
            operator = "In"
            values   = ["head", "worker"]
          },
        ]
      }
      # The rendered RayService names Ray's metrics export port (8080) `metrics` on every container.
      podMetricsEndpoints = [
        {
          port     = "metrics"
          path     = "/metrics"
          interval = var.ray_scrape_interval
        },
      ]
    }
  }

  depends_on = [helm_release.kube_prometheus_stack]
}
