"""Operations: autoscaling policy, rollout controller, draining, dashboards and alert rules.

Imports only the shunter core; talks to a running gateway through its admin API.
"""

# The room installs as shunter.ops only: the repository root on sys.path (a script or `python -c` run
# there) would also find this folder as a top-level `ops`, a second copy of every module with state of
# its own.
if __name__ != "shunter.ops":
    raise ImportError(f"import shunter.ops, not {__name__}: the same file under two names is two modules")
