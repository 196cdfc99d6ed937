"""A throwaway PostgreSQL server for tests: initdb in a temp dir, a Unix socket only, stopped afterwards.

The server binary comes from Debian's ``postgresql`` package (``.ci/run`` installs it when missing): it is
the server users run, it is already on the CI image, and the PyPI packages that bundle a server binary
are unofficial rebuilds with no wheel for this Python. The server listens on a Unix socket in its temp
dir and on no TCP port, so parallel runs never collide on a port. PostgreSQL refuses to run as root;
under root the server runs as the ``postgres`` user the package creates.

Where no server can be started the tests skip with the reason; ``TREEGRAFT_REQUIRE_POSTGRES=1`` (set by
``.ci/run``) turns that skip into a failure, so CI cannot pass without running them.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REQUIRE_ENV = "TREEGRAFT_REQUIRE_POSTGRES"
USER = "treegraft"


def unavailable(reason: str):
    """Skip, or fail where CI requires the server."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"PostgreSQL tests required ({REQUIRE_ENV}=1) but {reason}")
    pytest.skip(reason)


def binaries() -> Path | None:
    """The directory of ``initdb`` and ``pg_ctl``: on PATH, else the newest Debian install."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    installs = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0)
    return installs[-1].parent if installs else None


class Server:
    """One running server; ``url(name)`` creates database ``name`` and returns its SQLAlchemy URL."""

    def __init__(self):
        bin_dir = binaries()
        if bin_dir is None:
            unavailable("no PostgreSQL server binaries (apt-get install postgresql)")
        self.bin = bin_dir
        self.runner: list[str] = []
        self.root = Path(tempfile.mkdtemp(prefix="treegraft-pg-"))
        if os.geteuid() == 0:  # postgres will not run as root
            try:
                account = pwd.getpwnam("postgres")
            except KeyError:
                shutil.rmtree(self.root)
                unavailable("running as root and there is no 'postgres' user to run the server as")
            os.chown(self.root, account.pw_uid, account.pw_gid)
            self.runner = ["runuser", "-u", "postgres", "--"]
        self.data = self.root / "data"
        self.started = False

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self.runner, str(self.bin / tool), *args], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            log = self.root / "server.log"
            detail = (done.stderr or done.stdout).strip() + (f"\n{log.read_text()}" if log.exists() else "")
            raise RuntimeError(f"{tool} failed: {detail}")

    def start(self) -> Server:
        try:
            self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "--no-sync", "-E", "UTF8")
            options = f"-k {self.root} -c listen_addresses= -c fsync=off -c full_page_writes=off"
            self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60", "-o", options, "start")
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
            self.stop()
            unavailable(f"the PostgreSQL server did not start: {error}")
        self.started = True
        return self

    def url(self, database: str) -> str:
        import psycopg

        with psycopg.connect(host=str(self.root), user=USER, dbname="postgres", autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{database}"')
        return f"postgresql://{USER}@/{database}?host={self.root}"

    def stop(self) -> None:
        try:
            if self.started:
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
                self.started = False
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
