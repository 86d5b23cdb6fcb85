# Shunter's RayService: KubeRay builds the Ray cluster it describes and deploys its Serve config
# (serveConfigV2). The manifest is rendered from a Shunter config beforehand; Terraform applies it in its
# own namespace, with every Ray container running var.image (when set) and reading an optional Hugging
# Face token Secret, so the committed rendering serves any registry's image without re-rendering.

locals {
  rendered = yamldecode(file(var.rayservice_manifest_path))
  name     = local.rendered.metadata.name
  cluster  = local.rendered.spec.rayClusterConfig

  # optional: pods start without the Secret; only gated models need it.
  token_env_from = [{ secretRef = { name = var.hf_token_secret_name, optional = true } }]

  head_group = merge(local.cluster.headGroupSpec, {
    template = merge(local.cluster.headGroupSpec.template, {
      spec = merge(local.cluster.headGroupSpec.template.spec, {
        containers = [
          for container in local.cluster.headGroupSpec.template.spec.containers :
          merge(container, {
            image   = coalesce(var.image, container.image)
            envFrom = concat(try(container.envFrom, []), local.token_env_from)
          })
        ]
      })
    })
  })

  worker_groups = [
    for group in try(local.cluster.workerGroupSpecs, []) : merge(group, {
      template = merge(group.template, {
        spec = merge(group.template.spec, {
          containers = [
            for container in group.template.spec.containers :
            merge(container, {
              image   = coalesce(var.image, container.image)
              envFrom = concat(try(container.envFrom, []), local.token_env_from)
            })
          ]
        })
      })
    })
  ]

  # KubeRay's own serve Service, as a load balancer: KubeRay points it at a new Ray cluster only once that
  # cluster's Serve apps are healthy, so an upgrade never routes requests early (a Service of our own
  # selecting ray.io/serve=true would).
  public_serve_service = {
    serveService = {
      metadata = {
        name        = "${local.name}-serve-svc"
        annotations = var.load_balancer_annotations
      }
      spec = {
        type                     = "LoadBalancer"
        loadBalancerSourceRanges = var.public_source_ranges
        ports                    = [{ name = "serve", port = 8000, targetPort = 8000, protocol = "TCP" }]
      }
    }
  }

  # The usage ledger's claims (the rendered head pod mounts one at /home/ray/.shunter): made here.
  usage_claims = [
    for volume in try(local.cluster.headGroupSpec.template.spec.volumes, []) :
    volume.persistentVolumeClaim.claimName if can(volume.persistentVolumeClaim.claimName)
  ]

  manifest = merge(local.rendered, {
    metadata = merge(local.rendered.metadata, { namespace = kubernetes_namespace_v1.this.metadata[0].name })
    spec = merge(local.rendered.spec, var.public_endpoint ? local.public_serve_service : {}, {
      rayClusterConfig = merge(local.cluster, {
        headGroupSpec    = local.head_group
        workerGroupSpecs = local.worker_groups
      })
    })
  })
}

resource "kubernetes_namespace_v1" "this" {
  metadata {
    name = var.namespace
    labels = {
      "app.kubernetes.io/part-of" = "shunter"
    }
  }
}

resource "kubernetes_secret_v1" "hf_token" {
  count = var.hf_token == null ? 0 : 1

  metadata {
    name      = var.hf_token_secret_name
    namespace = kubernetes_namespace_v1.this.metadata[0].name
  }

  data = {
    HF_TOKEN = var.hf_token
  }
}

# The config's API keys (auth.keys, auth.admin_keys with key_env): the rendered manifest has every Ray
# container read this Secret's entries as environment variables. The keys are in Terraform's state, like
# the HF token: keep the state in an encrypted backend, or create the Secret with kubectl instead.
resource "kubernetes_secret_v1" "api_keys" {
  count = length(var.api_keys) > 0 ? 1 : 0

  metadata {
    name      = "shunter-api-keys"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
  }

  data = var.api_keys
}

# The usage ledger's volume: SQLite on the head pod (usage.path under ~/.shunter). A claim of its own, not
# the RayService's, so the ledger outlives head pods, Ray clusters and RayService upgrades. Not waited for:
# a WaitForFirstConsumer storage class binds it only once the head pod is scheduled.
resource "kubernetes_persistent_volume_claim_v1" "usage" {
  for_each = toset(local.usage_claims)

  metadata {
    name      = each.value
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels = {
      "app.kubernetes.io/part-of" = "shunter"
    }
  }

  spec {
    access_modes       = ["ReadWriteOnce"]
    storage_class_name = var.usage_storage_class
    resources {
      requests = {
        storage = var.usage_volume_size
      }
    }
  }

  wait_until_bound = false
}

resource "kubernetes_manifest" "rayservice" {
  manifest = local.manifest

  # Server-side apply: take over fields someone changed with kubectl rather than fail the apply.
  field_manager {
    force_conflicts = true
  }

  # KubeRay sets Ready once the Serve applications answer through the serve service.
  wait {
    condition {
      type   = "Ready"
      status = "True"
    }
  }

  timeouts {
    create = var.ready_timeout
    update = var.ready_timeout
    delete = "30m"
  }

  depends_on = [kubernetes_secret_v1.hf_token, kubernetes_secret_v1.api_keys, kubernetes_persistent_volume_claim_v1.usage]
}

# Read back after the RayService is Ready: KubeRay creates the serve Service, the cloud its load balancer.
data "kubernetes_service_v1" "serve" {
  count = var.public_endpoint ? 1 : 0

  metadata {
    name      = "${local.name}-serve-svc"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
  }

  depends_on = [kubernetes_manifest.rayservice]
}
