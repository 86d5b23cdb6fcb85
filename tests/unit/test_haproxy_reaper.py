"""A cluster's HAProxy is stopped once the cluster is down (shunter.local_serve.reap_haproxy): the one a
reload started is not stopped by Ray when the proxy actor dies, and stayed after each full test run. Only a
process named haproxy whose arguments name a file in that cluster's folder is stopped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shunter.local_serve import reap_haproxy

pytestmark = pytest.mark.unit


def _stand_in(config: str) -> subprocess.Popen:
    """A process whose command line reads as HAProxy's (`haproxy ... -f <config>`): Python, named haproxy."""
    return subprocess.Popen(["haproxy", "-c", "import time; time.sleep(120)", "-f", config],
                            executable=sys.executable)


def test_only_the_clusters_own_haproxy_is_stopped(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    mine, other = _stand_in(str(ours / "4d1f")), _stand_in(str(theirs / "4d1f"))
    try:  # Popen returns once each has exec'd: their command lines are in place
        assert reap_haproxy(str(ours)) == [mine.pid]
        assert mine.wait(timeout=10) is not None
        assert other.poll() is None, "another cluster's HAProxy keeps running"
        assert reap_haproxy(str(ours)) == [], "nothing left to stop"
        assert reap_haproxy(None) == [] and reap_haproxy("") == []
    finally:
        for proc in (mine, other):
            proc.kill()
            proc.wait()
