"""Operations: autoscaling policy, rollout controller, draining, dashboards and alert rules.

Imports only the shunter core; talks to a running gateway through its admin API.
"""
