"""Ray Serve deployments: the Gateway (HTTP ingress) and the ModelServer (one vLLM engine per replica).

`shunter.deployments.app:build_app` is the import_path of every Serve config.
"""
