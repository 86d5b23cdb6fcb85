"""A real PostgreSQL for the tests: Debian's server binaries (ops/install-postgresql.sh puts them there),
a cluster of its own in a temporary folder, on a free port of 127.0.0.1, stopped at the end. As root (CI)
the server runs as the package's `postgres` user, since PostgreSQL refuses to run as root."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shunter.local_serve import free_port


def server_bin() -> Path:
    """The folder of initdb and pg_ctl: Debian's versioned folder (the newest), else PATH's."""
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if versions:
        return Path(versions[-1]).parent
    found = shutil.which("initdb")
    if found is None:
        raise RuntimeError("PostgreSQL's server is not installed: run `bash ops/install-postgresql.sh` (make test does)")
    return Path(found).parent


@contextmanager
def postgres_server() -> Iterator[str]:
    """Yields the server's URL (`postgresql://shunter@127.0.0.1:<port>/postgres`, no password)."""
    bindir = server_bin()
    root = os.geteuid() == 0
    folder = Path(tempfile.mkdtemp(prefix="shunter-pg-"))
    folder.chmod(0o755)
    data = folder / "data"
    data.mkdir()
    as_user: list[str] = []
    if root:
        user = pwd.getpwnam("postgres")
        os.chown(data, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    log = folder / "server.log"
    if root:
        log.touch()
        os.chown(log, pwd.getpwnam("postgres").pw_uid, -1)
    quiet = {"check": True, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(data), "-U", "shunter", "--auth=trust",
                    "-E", "UTF8", "--no-sync"], **quiet)
    options = f"-p {port} -k {data} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w",
                    "-t", "60", "start"], **quiet)
    try:
        yield f"postgresql://shunter@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(folder, ignore_errors=True)
