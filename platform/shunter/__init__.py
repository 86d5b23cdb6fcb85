"""Shunter core: config schema, model catalog, vLLM engine adapter, CPU core allocation, CLI.

Imports nothing else of the project (deployments/, routing/, ops/ import this, never the reverse).
"""

__version__ = "0.1.0"
