output "release_name" {
  description = "Name of the device plugin's Helm release."
  value       = helm_release.this.name
}

output "chart_version" {
  description = "Version of the nvidia-device-plugin chart installed."
  value       = helm_release.this.version
}
