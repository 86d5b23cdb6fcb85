"""Finding the Prometheus to run: a missing one is a clear message naming how to install it."""

from __future__ import annotations

import pytest

from shunter.cli.demo.prometheus import PrometheusMissing, prometheus_binary


def test_a_missing_prometheus_says_how_to_install_it(monkeypatch):
    monkeypatch.delenv("SHUNTER_PROMETHEUS", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(PrometheusMissing, match="make prometheus"):
        prometheus_binary()


def test_shunter_prometheus_names_the_binary(monkeypatch, tmp_path):
    binary = tmp_path / "prometheus"
    binary.write_text("#!/bin/sh\n")
    monkeypatch.setenv("SHUNTER_PROMETHEUS", str(binary))
    with pytest.raises(PrometheusMissing, match="not an executable"):
        prometheus_binary()
    binary.chmod(0o755)
    assert prometheus_binary() == str(binary)
