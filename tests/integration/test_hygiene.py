"""A pytest session of the suite's own fixtures leaves no process behind: not when a
test fails, not when it is interrupted (Ctrl-C: SIGINT to its process group; or
SIGTERM, even SIGKILL, to the main pytest process), with embedded servers or with ``DATABASE_URL``
and ``REDIS_URL`` given.

Each test runs a small session in a pytest process of its own (on one xdist worker,
as the suite runs) whose test starts embedded PostgreSQL and Redis (``services``), a
worker with its beat through the ``workers`` fixture, and one more worker started
directly, which no fixture stops (as a test that fails before its own cleanup
leaves it). Every process of that session carries a mark of this test's among its
owners (``BATCHGEN_TEST_OWNERS``, :mod:`tests.reaper`; inherited by their children,
and by PostgreSQL, which ``pg_ctl`` starts as a daemon); once the session has ended,
no marked process is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchgen.embedded import RedisServer, free_port
from tests import reaper
from tests.invariants import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# How long a session's processes may take to stop once it has ended, and how long the
# inner session may take to start its servers and workers on a loaded machine.
STOPPED_S = 30
SESSION_S = 240

INNER_TEST = '''
"""Started by tests/integration/test_hygiene.py: servers and workers, then fail or wait."""

import os
from pathlib import Path

from batchgen.worker.procs import start_worker
from tests.invariants import wait_until


def test_starts_processes(services, workers, tmp_path):
    workers()  # a worker with its beat, stopped by the fixture
    start_worker(["batchgen.control"], log_dir=tmp_path / "own").wait_ready()  # by nobody
    Path(os.environ["HYGIENE_READY_FILE"]).write_text("ready")
    if os.environ["HYGIENE_MODE"] == "fail":
        raise AssertionError("fails on purpose")
    wait_until(lambda: False, 3600, "an interrupt")
'''

INNER_INI = """
[pytest]
timeout = 600
"""


@pytest.fixture
def inner(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A session folder with the inner test, and this test's mark (its processes are
    killed afterwards if any outlived the check)."""
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER_TEST))
    (tmp_path / "pytest.ini").write_text(INNER_INI)
    mark = uuid.uuid4().hex
    yield {"dir": tmp_path, "mark": mark, "ready": tmp_path / "ready"}
    reaper.reap(mark)


def start_session(
    inner: dict[str, Any], mode: str, servers: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """The inner session on one xdist worker, in a process group of its own (as a shell
    runs it), with the suite's conftest files as plugins; embedded servers of its own,
    or the ``DATABASE_URL`` and ``REDIS_URL`` of ``servers``."""
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "1"]
    argv += ["-p", "tests.conftest", "-p", "tests.integration.conftest"]
    argv += ["-c", str(inner["dir"] / "pytest.ini"), "--rootdir", str(inner["dir"])]
    argv += [str(inner["dir"] / "test_inner.py")]
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.update(servers or {})
    env = reaper.with_mark(env, inner["mark"])
    env.update({"HYGIENE_MODE": mode, "HYGIENE_READY_FILE": str(inner["ready"])})
    return subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def assert_nothing_left(mark: str, output: str) -> None:
    def none_left() -> bool:
        return not reaper.marked_processes(mark)

    try:
        wait_until(none_left, STOPPED_S, "the session's processes to stop")
    except AssertionError:
        left = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in reaper.marked_processes(mark)]
        raise AssertionError(f"left running: {left}\n{output[-3000:]}") from None


@pytest.fixture(params=["embedded", "given"])
def servers(request: Any, tmp_path: Path) -> Iterator[dict[str, str] | None]:
    """None: the session starts embedded servers. "given": ``DATABASE_URL`` and
    ``REDIS_URL`` set, as docs/install.md allows, to a Redis server of this test's own
    and this session's PostgreSQL server (the inner session makes a database there)."""
    if request.param == "embedded":
        yield None
        return
    services = request.getfixturevalue("services")
    redis_server = RedisServer(free_port(), tmp_path / "redis").start()
    yield {"DATABASE_URL": services["server_url"], "REDIS_URL": redis_server.url}
    redis_server.stop()


def test_a_failing_test_leaves_no_process(inner, servers):
    session = start_session(inner, "fail", servers)
    output, _ = session.communicate(timeout=SESSION_S)
    assert "fails on purpose" in output and session.returncode == 1, output[-3000:]
    assert_nothing_left(inner["mark"], output)


def interrupt(session: subprocess.Popen[str], how: str) -> None:
    """Ctrl-C in the shell that ran it (SIGINT to its process group: pytest and its
    xdist worker), or SIGTERM or SIGKILL to the main pytest process alone."""
    if how == "ctrl-c":
        os.killpg(session.pid, signal.SIGINT)
    else:
        session.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_an_interrupted_session_leaves_no_process(inner, how):
    session = start_session(inner, "wait")
    try:
        wait_until(
            lambda: inner["ready"].exists() or session.poll() is not None,
            SESSION_S,
            "the session's processes to start",
        )
        assert session.poll() is None, session.communicate()[0][-3000:]
        # Its workers, beat and servers are up: the marked processes say so.
        assert len(reaper.marked_processes(inner["mark"])) >= 5
        interrupt(session, how)
        try:
            output, _ = session.communicate(timeout=SESSION_S)
        except subprocess.TimeoutExpired:
            os.killpg(session.pid, signal.SIGKILL)
            raise AssertionError(f"still running: {session.communicate()[0][-3000:]}") from None
    finally:
        if session.poll() is None:
            os.killpg(session.pid, signal.SIGKILL)
            session.wait()
    assert session.returncode != 0, output[-3000:]
    assert_nothing_left(inner["mark"], output)
