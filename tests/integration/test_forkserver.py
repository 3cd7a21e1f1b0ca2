"""The suite's fork server (tests/forkserver.py) starts a command as ``exec`` would:
its arguments, environment, working folder, session, output and exit code."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forkserver
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(not forkserver.enabled(), reason="BATCHGEN_TEST_FORK=0")


def _probe(tmp_path: Path, *args: str) -> tuple[forkserver.ForkedProcess, Path]:
    log = tmp_path / "probe.log"
    log.write_bytes(b"")
    argv = [sys.executable, "-m", "tests.forkprobe", *args]
    env = {"FORKPROBE": "given", "PATH": "/usr/bin:/bin"}
    return forkserver.spawn(argv, env, log), log


def test_a_forked_command_sees_what_exec_would_give_it(tmp_path: Path) -> None:
    process, log = _probe(tmp_path, "3", "--flag")
    assert process.wait(60) == 3
    first, second = log.read_text().splitlines()
    seen = json.loads(first)
    assert seen == {
        "argv": ["3", "--flag"],
        "program": "forkprobe.py",
        "probe_env": "given",
        "session_leader": True,
        "cwd": str(Path.cwd()),
        "stdin": "",
        "netns": os.readlink("/proc/self/ns/net"),
        "sigint": "python",
    }
    assert second == "to stderr"


def test_a_ctrl_c_leaves_the_server_serving(tmp_path: Path) -> None:
    """A Ctrl-C reaches pytest's process group, the server with it: it keeps serving,
    so that pytest's teardown can still stop the children it forked."""
    first = forkserver.spawn([sys.executable, "-m", "tests.forkprobe", "0"], {}, tmp_path / "a.log")
    assert first.wait(60) == 0
    server = forkserver._SERVER._process
    assert server is not None
    server.send_signal(signal.SIGINT)
    process, _ = _probe(tmp_path, "4")
    assert process.wait(60) == 4
    assert server.poll() is None and forkserver._SERVER._process is server


def test_a_forked_command_ends_by_a_signal_as_popen_reports_it(tmp_path: Path) -> None:
    process, log = _probe(tmp_path, "wait")
    wait_until(lambda: log.read_text().count("\n") >= 2, 60, "the probe started")
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.1)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == -signal.SIGTERM
    process.kill()  # a no-op once it has ended
    assert process.poll() == -signal.SIGTERM


def test_the_switch_turns_forking_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(forkserver.SWITCH_ENV, "0")
    assert not forkserver.enabled()
    monkeypatch.setenv(forkserver.SWITCH_ENV, "1")
    assert forkserver.enabled() == sys.platform.startswith("linux")


def test_a_forked_command_joins_the_network_namespace_it_is_given(tmp_path: Path) -> None:
    ip = shutil.which("ip") or "/usr/sbin/ip"
    name = f"bgfork{os.getpid()}"
    made = subprocess.run([ip, "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"ip netns add: {made.stderr.strip()}")
    try:
        there = subprocess.run(
            [ip, "netns", "exec", name, "readlink", "/proc/self/ns/net"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        log = tmp_path / "netns.log"
        argv = [sys.executable, "-m", "tests.forkprobe", "0"]
        process = forkserver.spawn(argv, {}, log, netns=name)
        assert process.wait(60) == 0
        seen = json.loads(log.read_text().splitlines()[0])
        assert seen["netns"] == there != os.readlink("/proc/self/ns/net")
    finally:
        subprocess.run([ip, "netns", "del", name], capture_output=True)
