"""Processes started together on one data folder share its embedded Redis (the README's
quick start starts a worker, the dispatcher and the API at once)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

# Holds the servers until its stdin closes, so that every process is up at once.
HOLD = """
import os, sys
from pathlib import Path
from batchgen import embedded
with embedded.services(Path(sys.argv[1])):
    print(os.environ["REDIS_URL"], flush=True)
    sys.stdin.read()
"""


def test_processes_started_at_once_share_one_redis() -> None:
    folder = Path(tempfile.mkdtemp(prefix="batchgen-shared-"))
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BATCHGEN_REDIS_URL")}
    # A given address is used as it is (never connected to here): only Redis is embedded.
    env["BATCHGEN_DATABASE_URL"] = "postgresql://unused@127.0.0.1:1/unused"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HOLD, str(folder)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    try:
        urls = {p.stdout.readline().strip() for p in procs if p.stdout}
    finally:
        for p in procs:
            p.communicate("", timeout=30)
        shutil.rmtree(folder, ignore_errors=True)
    assert len(urls) == 1 and next(iter(urls)).startswith("redis://127.0.0.1:"), urls
