"""Request routing between replicas of a model version: routers, circuit breakers, complexity tiers.

Imports only the shunter core; knows nothing of the gateway.
"""

# The room installs as shunter.routing only: the repository root on sys.path (a script or `python -c` run
# there) would also find this folder as a top-level `routing`, a second copy of every module with state of
# its own.
if __name__ != "shunter.routing":
    raise ImportError(f"import shunter.routing, not {__name__}: the same file under two names is two modules")
