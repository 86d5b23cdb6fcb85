"""Imported by a test server's preload: records, as vLLM's Ray executor module does, whether ray imported."""

try:
    import ray
except ImportError:
    ray = None
