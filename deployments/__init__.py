"""Ray Serve deployments: the Gateway (HTTP ingress) and the ModelServer (one vLLM engine per replica).

`shunter.deployments.app:build_app` is the import_path of every Serve config.
"""

# The room installs as shunter.deployments only: the repository root on sys.path (a script or
# `python -c` run there) would also find this folder as a top-level `deployments`, a second copy of every
# module with state of its own.
if __name__ != "shunter.deployments":
    raise ImportError(f"import shunter.deployments, not {__name__}: "
                      "the same file under two names is two modules")
