"""Two test runs at once: the embedded PostgreSQL of one survives the start of another.

Run as root, pgserver runs the server as its own system user and opens the
folders above its data to that user. pytest re-applies mode 0700 to its shared
temporary root (``/tmp/pytest-of-<user>``) at every start, so a server whose
data lives under that root loses access to its files when another run starts.
The outer test runs a pytest of its own without ``DATABASE_URL`` / ``REDIS_URL``
(so the suite's fixture starts the embedded servers); inside it, a second
pytest run starts while the server runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
INNER = "BATCHGEN_TEST_INNER_RUN"


def _pytest(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n0", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_second_test_run_keeps_embedded_postgres_alive(tmp_path, repo_root):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env[INNER] = str(tmp_path)
    inner = f"{Path(__file__).relative_to(repo_root)}::test_embedded_server_outlives_another_run"
    done = _pytest(inner, cwd=repo_root, env=env)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:]


@pytest.mark.skipif(not os.environ.get(INNER), reason="run by the test above, on embedded servers")
def test_embedded_server_outlives_another_run(services):
    import psycopg

    url = services["server_url"]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CHECKPOINT")
    other = Path(os.environ[INNER]) / "other-run"
    other.mkdir()
    (other / "test_other.py").write_text("def test_tmp(tmp_path):\n    assert tmp_path.is_dir()\n")
    second = _pytest(str(other), cwd=other, env=dict(os.environ))
    assert second.returncode == 0, second.stdout
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CHECKPOINT")  # opens global/pg_control by its absolute path
        assert conn.execute("SELECT 1").fetchone() == (1,)
