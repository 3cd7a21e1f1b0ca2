"""The heartbeat's renewal loop (app/worker/heartbeat.py) outlives what it cannot read:
a renewal thread that died would let every lease it holds run out under a live worker."""

from __future__ import annotations

import threading

from batchgen.worker.heartbeat import Heartbeat


class _Flaky(Heartbeat):
    """A heartbeat whose interval cannot be read the first ``failures`` times (settings
    rebuilt while the environment changes under them)."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def interval_s(self) -> float:
        if self.failures:
            self.failures -= 1
            raise KeyError("COLUMNS")
        return 0.01


def test_an_unreadable_interval_keeps_the_loop_renewing() -> None:
    beat = _Flaky(failures=2)
    renewed = threading.Semaphore(0)
    thread = threading.Thread(target=beat._loop, args=("test", renewed.release), daemon=True)
    thread.start()
    try:
        for _ in range(3):  # two renewals at the kept wait, then at the interval read
            assert renewed.acquire(timeout=30), "the loop stopped renewing"
    finally:
        beat.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert beat.failures == 0
