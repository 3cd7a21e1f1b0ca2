"""The dispatcher's embedded beat: it dies with its dispatcher, even after ``kill -9``,
and only one beat sends the schedule's ticks at a time (a lease in Redis).

The dispatchers are started as the product starts them (``batchgen dispatcher``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis

from batchgen.worker import procs
from batchgen.worker.beat import schedule_holder
from batchgen.worker.procs import beat_pids
from tests.invariants import wait_until
from tests.waiting import hold

pytestmark = pytest.mark.integration
SENT = "Sending due task dispatch"
LEASE_S = 5.0  # long enough that a loaded machine does not lose it by a stall


@dataclass
class Dispatcher:
    process: procs.Process
    log: Path

    def sends(self) -> int:
        return self.log.read_text(errors="replace").count(SENT)

    def beat(self) -> int:
        """The pid of its embedded beat process, once there is one."""
        wait_until(lambda: beat_pids(self.process.pid), 30, f"a beat under {self.process.pid}")
        (pid,) = beat_pids(self.process.pid)
        return pid


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def dispatchers(clean_db, tmp_path) -> Iterator[Callable[[str], Dispatcher]]:
    """``batchgen dispatcher`` processes; killed with any beat they left behind."""
    started: list[Dispatcher] = []
    beats: list[int] = []

    def start(name: str) -> Dispatcher:
        log, ready = tmp_path / f"{name}.log", tmp_path / f"{name}.ready"
        env = {
            **os.environ,
            "BATCHGEN_DATA_DIR": str(tmp_path / name),
            "BATCHGEN_READY_FILE": str(ready),
            "BATCHGEN_BEAT_LOCK_LEASE_S": str(LEASE_S),
        }
        process = procs.default_spawn(
            [sys.executable, "-m", "batchgen.cli", "dispatcher"], env, log
        )
        d = Dispatcher(process, log)
        started.append(d)
        wait_until(ready.exists, 60, lambda: f"{name} ready: {log.read_text()[-2000:]}")
        beats.append(d.beat())
        return d

    yield start
    for d in started:
        if d.process.poll() is None:
            os.killpg(d.process.pid, signal.SIGTERM)
            try:
                d.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(d.process.pid, signal.SIGKILL)
                d.process.wait()
    for pid in beats:  # an orphan beat is no longer in its dispatcher's process group
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def control_queue_length(services: dict[str, str]) -> int:
    return int(redis.Redis.from_url(services["REDIS_URL"]).llen("batchgen.control"))


@pytest.mark.slow
def test_dispatcher_kill_9_takes_its_beat_along(dispatchers, services):
    client = redis.Redis.from_url(services["REDIS_URL"])
    d = dispatchers("d1")
    beat = d.beat()
    wait_until(lambda: d.sends() >= 2, 30, "a tick sent")
    assert (schedule_holder(client) or "").split(":")[1] == str(beat)  # names the beat's pid

    d.process.kill()  # kill -9 of the dispatcher alone, not of its process group
    d.process.wait()
    wait_until(lambda: gone(beat), 5, f"beat {beat} to go with its dispatcher")
    wait_until(
        lambda: schedule_holder(client) is None, 5, "the lock given back"
    )  # a clean stop gave it back

    # Nothing consumes the control queue now; an orphan beat would keep filling it.
    queued = control_queue_length(services)
    hold(3, "three dispatch intervals: the absence of ticks has no event to await")
    assert control_queue_length(services) == queued


@pytest.mark.slow
def test_two_dispatchers_one_schedule(dispatchers):
    first = dispatchers("d1")
    second = dispatchers("d2")
    wait_until(lambda: "beat: Starting" in second.log.read_text(), 30, "the second beat")
    base = first.sends(), second.sends()
    wait_until(lambda: first.sends() + second.sends() >= sum(base) + 4, 30, "ticks")
    holder, waiter = (first, second) if first.sends() > base[0] else (second, first)
    assert waiter.sends() == base[waiter is second], "two beats send the schedule"
    assert "holds the schedule" in waiter.log.read_text()
    # The ticks ran, and Celery's per-task lines about them were left out of the logs.
    logs = first.log.read_text() + second.log.read_text()
    assert "Task batchgen.dispatch[" not in logs and "Task batchgen.sweep[" not in logs

    # The holder's dispatcher is killed (restart case): the other beat takes over
    # once the lease ends, and it alone sends.
    holder_beat = holder.beat()
    holder.process.kill()
    holder.process.wait()
    wait_until(lambda: gone(holder_beat), 5, "the killed dispatcher's beat to go")
    before = waiter.sends()
    wait_until(lambda: waiter.sends() >= before + 2, 2 * LEASE_S + 5, "a takeover")


def test_schedule_lock_has_one_holder_and_a_lease(clean_db):
    from batchgen.limits.backend import get_redis
    from batchgen.worker.beat import ScheduleLock

    a, b = ScheduleLock(get_redis(), lease_s=0.5), ScheduleLock(get_redis(), lease_s=0.5)
    assert a.hold() and not b.hold()
    assert a.hold()  # renewed by its holder
    wait_until(b.hold, 5, "the lease to run out")  # the holder stopped renewing
    assert not a.hold()
    a.release()  # not a's any more: nothing happens
    assert not a.hold()
    b.release()
    assert a.hold()
