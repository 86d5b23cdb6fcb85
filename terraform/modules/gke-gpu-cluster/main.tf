# A private, VPC-native GKE Standard cluster with a CPU "system" pool and one autoscaled pool per GPU
# kind. GKE installs the NVIDIA driver and its own device plugin on GPU nodes (gpu_driver_installation_config),
# so this cloud needs no device-plugin chart; the pools' own autoscaler adds nodes for pending pods, so it
# needs no cluster-autoscaler chart either.

locals {
  # The same taint and label the EKS groups carry: the rendered RayService's GPU pods tolerate the one and
  # select the other, so one rendering runs on both clouds.
  gpu_taint = {
    key    = "nvidia.com/gpu"
    value  = "present"
    effect = "NO_SCHEDULE"
  }

  system_labels = {
    "shunter.io/node-role" = "system"
  }

  labels = merge({ project = "shunter", managed-by = "terraform" }, var.labels)

  # Google's recommended scopes for a node service account that holds only the roles below.
  node_roles = [
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
    "roles/monitoring.viewer",
    "roles/stackdriver.resourceMetadata.writer",
    "roles/artifactregistry.reader", # pull the Shunter image from Artifact Registry in this project
  ]
}

resource "google_project_service" "this" {
  for_each = toset(["compute.googleapis.com", "container.googleapis.com", "iam.googleapis.com", "binaryauthorization.googleapis.com"])

  project = var.project_id
  service = each.value

  # Other workloads of the project may use these APIs: leave them on at destroy.
  disable_on_destroy = false
}

resource "google_compute_network" "this" {
  name                    = var.cluster_name
  project                 = var.project_id
  auto_create_subnetworks = false

  depends_on = [google_project_service.this]
}

# Ingress is closed unless allowed: GKE adds the rules its control plane and load balancers need above this
# one; this rule only makes the default explicit and logs what it drops.
resource "google_compute_firewall" "deny_ingress" {
  name      = "${var.cluster_name}-deny-ingress"
  project   = var.project_id
  network   = google_compute_network.this.id
  direction = "INGRESS"
  priority  = 65534

  deny {
    protocol = "all"
  }

  source_ranges = ["0.0.0.0/0"]

  log_config {
    metadata = "EXCLUDE_ALL_METADATA"
  }
}

resource "google_compute_subnetwork" "nodes" {
  name                     = "${var.cluster_name}-nodes"
  project                  = var.project_id
  region                   = var.region
  network                  = google_compute_network.this.id
  ip_cidr_range            = var.nodes_cidr
  private_ip_google_access = true

  secondary_ip_range {
    range_name    = "pods"
    ip_cidr_range = var.pods_cidr
  }

  secondary_ip_range {
    range_name    = "services"
    ip_cidr_range = var.services_cidr
  }

  log_config {
    aggregation_interval = "INTERVAL_10_MIN"
    flow_sampling        = 0.1
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

# Private nodes have no public address: image and model downloads leave through Cloud NAT.
resource "google_compute_router" "this" {
  name    = var.cluster_name
  project = var.project_id
  region  = var.region
  network = google_compute_network.this.id
}

resource "google_compute_router_nat" "this" {
  name                               = var.cluster_name
  project                            = var.project_id
  region                             = var.region
  router                             = google_compute_router.this.name
  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "ALL_SUBNETWORKS_ALL_IP_RANGES"

  log_config {
    enable = true
    filter = "ERRORS_ONLY"
  }
}

# Nodes run as this account, never as the Compute Engine default account (which holds Editor).
resource "google_service_account" "nodes" {
  project      = var.project_id
  account_id   = "${var.cluster_name}-nodes"
  display_name = "GKE nodes of ${var.cluster_name}"

  depends_on = [google_project_service.this]
}

resource "google_project_iam_member" "nodes" {
  for_each = toset(local.node_roles)

  project = var.project_id
  role    = each.value
  member  = "serviceAccount:${google_service_account.nodes.email}"
}

resource "google_container_cluster" "this" {
  #checkov:skip=CKV_GCP_65:Google Groups for RBAC needs a Workspace or Cloud Identity domain of the operator's; add authenticator_groups_config where there is one
  name                = var.cluster_name
  project             = var.project_id
  location            = var.region
  node_locations      = var.zones
  network             = google_compute_network.this.id
  subnetwork          = google_compute_subnetwork.nodes.id
  min_master_version  = var.kubernetes_version
  deletion_protection = var.deletion_protection
  resource_labels     = local.labels

  # Node pools are separate resources below: changing one never recreates the cluster.
  remove_default_node_pool = true
  initial_node_count       = 1

  # Only for the default pool's one node, which lives until the pool is removed: it too runs as the nodes'
  # own account, not as the Compute Engine default account. Ignored afterwards: GKE reports no node_config
  # once the pool is gone, and a diff here would recreate the cluster.
  node_config {
    service_account = google_service_account.nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    workload_metadata_config {
      mode = "GKE_METADATA"
    }
  }

  lifecycle {
    ignore_changes = [node_config]
  }

  release_channel {
    channel = "REGULAR"
  }

  networking_mode = "VPC_NATIVE"
  ip_allocation_policy {
    cluster_secondary_range_name  = "pods"
    services_secondary_range_name = "services"
  }

  private_cluster_config {
    enable_private_nodes    = true
    enable_private_endpoint = false # Terraform and kubectl reach the API from api_access_cidrs
    master_ipv4_cidr_block  = var.master_cidr
  }

  master_authorized_networks_config {
    dynamic "cidr_blocks" {
      for_each = var.api_access_cidrs
      content {
        cidr_block   = cidr_blocks.value
        display_name = "api-access-${cidr_blocks.key}"
      }
    }
  }

  master_auth {
    client_certificate_config {
      issue_client_certificate = false
    }
  }

  # Dataplane V2 enforces Kubernetes network policies itself. The older Calico add-on cannot run beside
  # it: the block says so explicitly (checkov's network-policy check reads it; the API receives nothing).
  datapath_provider = "ADVANCED_DATAPATH"
  network_policy {
    enabled = false
  }
  enable_intranode_visibility = true
  enable_shielded_nodes       = true

  workload_identity_config {
    workload_pool = "${var.project_id}.svc.id.goog"
  }

  binary_authorization {
    evaluation_mode = "PROJECT_SINGLETON_POLICY_ENFORCE"
  }

  logging_config {
    enable_components = ["SYSTEM_COMPONENTS", "WORKLOADS"]
  }

  # Shunter's metrics go to the in-cluster Prometheus (modules/monitoring), not to Managed Prometheus.
  monitoring_config {
    enable_components = ["SYSTEM_COMPONENTS"]
    managed_prometheus {
      enabled = false
    }
  }

  maintenance_policy {
    daily_maintenance_window {
      start_time = var.maintenance_start_time
    }
  }

  depends_on = [google_project_service.this]
}

resource "google_container_node_pool" "system" {
  name               = "system"
  project            = var.project_id
  location           = var.region
  cluster            = google_container_cluster.this.id
  initial_node_count = 1 # per zone; the autoscaler keeps the totals below

  autoscaling {
    total_min_node_count = var.system_node_pool.min_nodes
    total_max_node_count = var.system_node_pool.max_nodes
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    machine_type    = var.system_node_pool.machine_type
    disk_size_gb    = var.system_node_pool.disk_size_gb
    disk_type       = "pd-balanced"
    image_type      = "COS_CONTAINERD"
    service_account = google_service_account.nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    labels          = local.system_labels
    resource_labels = local.labels

    metadata = {
      disable-legacy-endpoints = "true"
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    workload_metadata_config {
      mode = "GKE_METADATA"
    }
  }

  depends_on = [google_project_iam_member.nodes]
}

resource "google_container_node_pool" "gpu" {
  for_each = var.gpu_node_pools

  name               = "gpu-${each.key}"
  project            = var.project_id
  location           = var.region
  cluster            = google_container_cluster.this.id
  node_locations     = each.value.zones # null: the cluster's zones
  initial_node_count = 0                # a GPU node runs only while Ray has a worker pod for it

  autoscaling {
    total_min_node_count = each.value.min_nodes
    total_max_node_count = each.value.max_nodes
    # GPUs are scarce: take capacity in whichever zone has it rather than balance the zones.
    location_policy = "ANY"
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  # An upgrade replaces one node at a time and never takes one away first: a replica's GPUs stay serving.
  upgrade_settings {
    max_surge       = 1
    max_unavailable = 0
  }

  node_config {
    machine_type    = each.value.machine_type
    spot            = each.value.spot
    disk_size_gb    = each.value.disk_size_gb # the Ray image with vLLM is large, and weights are cached here
    disk_type       = "pd-balanced"
    image_type      = "COS_CONTAINERD"
    service_account = google_service_account.nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    resource_labels = local.labels

    labels = {
      "shunter.io/accelerator" = each.value.accelerator
    }

    guest_accelerator {
      type  = each.value.gpu_type
      count = each.value.gpus_per_node

      gpu_driver_installation_config {
        gpu_driver_version = "LATEST"
      }
    }

    # GKE taints GPU nodes by itself only while another pool exists; the default pool is gone and the
    # system pool may come up after this one, so the taint is set here rather than left to GKE.
    taint {
      key    = local.gpu_taint.key
      value  = local.gpu_taint.value
      effect = local.gpu_taint.effect
    }

    metadata = {
      disable-legacy-endpoints = "true"
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    workload_metadata_config {
      mode = "GKE_METADATA"
    }
  }

  depends_on = [google_project_iam_member.nodes]
}
