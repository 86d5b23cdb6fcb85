variable "namespace" {
  type        = string
  description = "Namespace created for the RayService; overrides whatever namespace the rendered manifest names."
  default     = "shunter"
}

variable "rayservice_manifest_path" {
  type        = string
  description = "Path of the RayService manifest rendered by `shunter render kuberay CONFIG -o FILE`."

  validation {
    condition     = try(yamldecode(file(var.rayservice_manifest_path)).kind, "") == "RayService"
    error_message = "No RayService manifest at rayservice_manifest_path: render one first (shunter render kuberay configs/gpu-llama-8b.yaml -o FILE --image IMAGE)."
  }
}

variable "image" {
  type        = string
  default     = null
  description = "The Ray image with Shunter installed (platform/Dockerfile) for every Ray container; null keeps the rendered manifest's image."
}

variable "ready_timeout" {
  type        = string
  description = "How long an apply waits for the RayService's Ready condition (GPU nodes start and models load first)."
  default     = "45m"
}

variable "hf_token" {
  type        = string
  description = "Hugging Face token for gated models (Llama): stored in a Secret every Ray container reads as HF_TOKEN. Null: no Secret."
  default     = null
  sensitive   = true
}

variable "hf_token_secret_name" {
  type        = string
  description = "Name of the Secret holding HF_TOKEN. The containers read it when it exists, created here or by hand."
  default     = "hf-token"
}

variable "public_endpoint" {
  type        = bool
  default     = false
  description = "Make KubeRay's serve Service (port 8000) a load balancer reachable from public_source_ranges."
}

variable "load_balancer_annotations" {
  type        = map(string)
  default     = {}
  description = "Annotations of the public serve Service that choose the cloud's load balancer (on AWS: an NLB, whose 350 s idle timeout outlasts long non-streamed generations where a classic ELB cuts at 60 s)."
}

variable "public_source_ranges" {
  type        = list(string)
  default     = []
  description = "CIDR ranges allowed to reach the public endpoint. Narrow them even with API keys configured."
}

variable "api_keys" {
  type        = map(string)
  description = "API keys by environment variable name (the config's key_env, e.g. SHUNTER_KEY_TEAM_A), stored in the Secret shunter-api-keys that every Ray container reads. Empty: no Secret is created here (create it with kubectl); a config with keys waits for it."
  default     = {}
  sensitive   = true

  validation {
    condition     = alltrue([for name, key in var.api_keys : can(regex("^[A-Za-z_][A-Za-z0-9_]*$", name)) && length(key) >= 16])
    error_message = "api_keys maps environment variable names to keys of at least 16 characters (shunter keys new makes one)."
  }
}

variable "usage_volume_size" {
  type        = string
  default     = "10Gi"
  description = "Size of the usage ledger's volume (SQLite on the head pod; a few hundred bytes per request)."
}

variable "usage_storage_class" {
  type        = string
  default     = null
  description = "Storage class of the usage ledger's volume: a block volume (EBS, Persistent Disk), not NFS/EFS, whose locking SQLite's WAL cannot use. Null: the cluster's default."
}
