"""A worker that has shut down ends its process at once (no interpreter teardown),
with its own exit code and every log line written."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from batchgen.registry import get_registry
from batchgen.worker.procs import start_worker


@pytest.mark.parametrize(("stop_signal", "exit_code"), [(signal.SIGTERM, 0), (signal.SIGINT, 1)])
def test_a_worker_exits_with_its_code_and_its_logs_written(
    clean_db, tmp_path: Path, stop_signal: signal.Signals, exit_code: int
):
    worker = start_worker(list(get_registry().queues), log_dir=tmp_path).wait_ready()
    os.killpg(worker.process.pid, stop_signal)
    assert worker.process.wait(30) == exit_code
    log = worker.log_path.read_text()
    assert "Warm shutdown" in log
    # Logged by the last exit handler, right before the process ends: nothing was lost.
    assert log.rstrip().endswith(f"worker shut down; exit code {exit_code}")
