"""Shunter's Grafana dashboards as code: `dashboards` defines them over the metric catalog
(`shunter.metric_catalog`), `builder` makes the Grafana JSON, `generate` writes ops/grafana/ and
checks it is current (`python -m shunter.ops.dashboards --check`), and `promql_names` lets tests hold every
query to the catalog.
"""
