"""Request routing between replicas of a model version: routers, circuit breakers, complexity tiers.

Imports only the shunter core; knows nothing of the gateway.
"""
