"""A PostgreSQL primary and its streaming standby (``pg_basebackup -R``) of a test's
own, from the system's PostgreSQL binaries, on loopback ports of their own; run as
the ``postgres`` system user when the tests run as root (PostgreSQL refuses root).

The servers are daemons (``pg_ctl``): :meth:`PrimaryStandby.stop` stops them, and
:func:`tests.reaper.guard_daemon` stops them when the session dies first.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from batchgen.embedded import free_port
from tests import reaper


def pg_bin() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` with pg_basebackup, if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_basebackup"))
    return Path(found[-1]).parent if found else None


@dataclass
class PrimaryStandby:
    """``primary`` streams to ``standby``; :meth:`promote` makes the standby primary."""

    bin_dir: Path
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pg-ha-")))
    primary_port: int = field(default_factory=free_port)
    standby_port: int = field(default_factory=free_port)

    def _run(self, tool: str, *args: str) -> None:
        user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run(
            [*user, str(self.bin_dir / tool), *args],
            check=True,
            capture_output=True,
            timeout=120,
            cwd=self.base,
        )

    def _dir(self, name: str) -> str:
        return str(self.base / name)

    def _start(self, name: str, port: int) -> None:
        options = f"-p {port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            "pg_ctl", "-D", self._dir(name), "-o", options, "-l", f"{name}.log", "-w", "start"
        )
        pid = int((self.base / name / "postmaster.pid").read_text().split()[0])
        reaper.guard_daemon(pid)

    def start(self) -> PrimaryStandby:
        if os.geteuid() == 0:
            os.chown(self.base, pwd.getpwnam("postgres").pw_uid, -1)
        self._run("initdb", "-D", self._dir("primary"), "-U", "postgres", "--auth=trust")
        self._start("primary", self.primary_port)
        self._run(
            "pg_basebackup",
            *("-h", "127.0.0.1", "-p", str(self.primary_port), "-U", "postgres"),
            *("-D", self._dir("standby"), "-R", "-X", "stream"),
        )
        self._start("standby", self.standby_port)
        return self

    def url(self) -> str:
        """Both servers, the standby first: only ``target_session_attrs=read-write``
        makes the client pass it by."""
        hosts = f"host=127.0.0.1:{self.standby_port}&host=127.0.0.1:{self.primary_port}"
        return f"postgresql://postgres@/postgres?{hosts}&target_session_attrs=read-write"

    def stop_primary(self) -> None:
        """As a crash: no shutdown checkpoint."""
        self._run("pg_ctl", "-D", self._dir("primary"), "-m", "immediate", "stop")

    def promote(self) -> None:
        self._run("pg_ctl", "-D", self._dir("standby"), "-w", "promote")

    def stop(self) -> None:
        for name in ("standby", "primary"):
            if (self.base / name / "postmaster.pid").exists():
                with contextlib.suppress(subprocess.CalledProcessError):
                    self._run("pg_ctl", "-D", self._dir(name), "-m", "immediate", "stop")
        shutil.rmtree(self.base, ignore_errors=True)


def need_pg_binaries() -> Path:
    found = pg_bin()
    if found is None:
        pytest.skip("needs PostgreSQL's server binaries (/usr/lib/postgresql/*/bin)")
    return found
