"""Render Grafana dashboard panels to PNG from a real Prometheus, with no Grafana server.

`make demo` runs a short load against a live Shunter app while a local Prometheus
(`shunter.cli.demo.prometheus`) scrapes Ray's metrics exporter, then sends the generated dashboards' own
PromQL, with Grafana's variables filled in as Grafana would (`variables`), to Prometheus as range
queries and draws the key panels with matplotlib (`render`); the README shows one of the images.
Rendering the real dashboard JSON, rather than hand-written plots, also proves that the dashboards'
queries name metrics that really exist and return data.

Drawing approximates Grafana: stat and gauge panels show the reduced value over a sparkline (no dial),
thresholds, overrides and transformations are ignored, and common units are formatted. A variable with
no saved value means "All" (there is no Grafana to run its options query).
"""
