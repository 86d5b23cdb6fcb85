"""A real Prometheus, run locally: it scrapes Ray's metrics exporter and answers the dashboards' PromQL.

`shunter demo` and the dashboard tests start one (`Prometheus(targets)`), let it scrape a live app, and
ask its HTTP API (`query`, `query_range`), so every number a panel shows comes from the same engine
an operator's Grafana queries, with Prometheus's own rate extrapolation, staleness and histogram rules.
The binary is the system's `prometheus` (Debian's package: `make prometheus` installs it where missing,
as root) or the one `SHUNTER_PROMETHEUS` names. Its data lives in a temporary directory and goes with it.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from shunter.cli.demo.panels.variables import format_duration
from shunter.local_serve import free_port

INSTALL_HINT = ("install it with `make prometheus` (as root: Debian's package, apt-get install prometheus), "
                "or put a Prometheus 2.x binary on PATH, or name it in SHUNTER_PROMETHEUS")


class PrometheusMissing(RuntimeError):
    pass


class PrometheusError(RuntimeError):
    """Prometheus refused a query (bad PromQL) or did not start."""


def prometheus_binary() -> str:
    """The Prometheus to run: SHUNTER_PROMETHEUS, else `prometheus` on PATH."""
    named = os.environ.get("SHUNTER_PROMETHEUS")
    if named:
        if not os.access(named, os.X_OK):
            raise PrometheusMissing(f"SHUNTER_PROMETHEUS={named} is not an executable file")
        return named
    found = shutil.which("prometheus")
    if found is None:
        raise PrometheusMissing(f"Prometheus is not installed: {INSTALL_HINT}")
    return found


class Prometheus:
    """A Prometheus scraping `targets` (host:port of Prometheus text endpoints) every `scrape_interval_s`.

    A context manager: entering starts it and waits until it is ready, leaving stops it and deletes its
    data. Queries go to its HTTP API; the results are Prometheus's own JSON `result` lists."""

    def __init__(self, targets: list[str], scrape_interval_s: float = 2.0, port: int | None = None):
        self.targets, self.scrape_interval_s = targets, scrape_interval_s
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._client = httpx.Client(base_url=self.url, timeout=30)

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self, ready_timeout_s: float = 60) -> None:
        binary = prometheus_binary()
        self._dir = tempfile.TemporaryDirectory(prefix="shunter-prometheus-")
        home = Path(self._dir.name)
        interval = format_duration(self.scrape_interval_s)
        (home / "prometheus.yml").write_text(
            "global:\n"
            f"  scrape_interval: {interval}\n"
            f"  scrape_timeout: {format_duration(min(self.scrape_interval_s, 10.0))}\n"
            "scrape_configs:\n"
            "  - job_name: ray\n"
            f"    static_configs: [{{targets: [{', '.join(repr(t) for t in self.targets)}]}}]\n")
        log = (home / "prometheus.log").open("wb")
        self._process = subprocess.Popen(
            [binary, f"--config.file={home / 'prometheus.yml'}", f"--storage.tsdb.path={home / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise PrometheusError(f"Prometheus exited with {self._process.returncode}: {self.log_tail()}")
            try:
                if self._client.get("/-/ready").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise PrometheusError(f"Prometheus was not ready within {ready_timeout_s:g}s")

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def log_tail(self, chars: int = 2000) -> str:
        if self._dir is None:
            return ""
        path = Path(self._dir.name) / "prometheus.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    # ---- the HTTP API ---------------------------------------------------------------------------------------

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query: Prometheus's result list (vector samples; a scalar as one sample)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        return self._api("/api/v1/query", params)

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        """A range query: one `{"metric": labels, "values": [[t, "v"], ...]}` per series."""
        return self._api("/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": step_s})

    def wait_scraped(self, timeout_s: float = 60) -> None:
        """Until every target has been scraped successfully at least once."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            up = self.query("up")
            if len(up) >= len(self.targets) and all(sample["value"][1] == "1" for sample in up):
                return
            time.sleep(0.5)
        raise PrometheusError(f"Prometheus did not scrape {self.targets} within {timeout_s:g}s "
                              f"(`up`: {self.query('up')})")

    def _api(self, path: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        response = self._client.post(path, data=params)
        body = response.json()
        if body.get("status") != "success":
            raise PrometheusError(f"{body.get('errorType', response.status_code)}: {body.get('error')} "
                                  f"(query {params['query']!r})")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        if data["resultType"] == "string":
            raise PrometheusError(f"query {params['query']!r} returns a string, not numbers")
        return data["result"]


def values_of(series: dict[str, Any]) -> list[tuple[float, float]]:
    """A range-query series' points as numbers (Prometheus sends values as strings: "NaN", "+Inf")."""
    return [(float(t), float(v)) for t, v in series.get("values", [])]


def has_data(result: list[dict[str, Any]]) -> bool:
    """Whether a query result holds at least one number (NaN is no data)."""
    for series in result:
        points = series["values"] if "values" in series else [series["value"]]
        if any(not math.isnan(float(v)) for _, v in points):
            return True
    return False
