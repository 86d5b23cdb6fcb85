"""`shunter bench`: load generation and measurement for any OpenAI-compatible endpoint.

records  what one request measured (the shared shape)
workloads  seeded, reproducible request streams: random, shared-prefix, multi-turn
loadgen  async client: fixed concurrency or Poisson arrivals, streaming chat and completions
stats    percentiles, throughput, goodput against SLOs
plots    latency CDFs and comparison charts (matplotlib, written as PNG)
"""
