"""The host's CPU counters a slow pack reads before handing its rest back."""

from __future__ import annotations

from collections import namedtuple

import pytest

from batchgen.worker import host_cpu

Times = namedtuple("Times", "user nice system idle iowait guest guest_nice")


def _counters(monkeypatch: pytest.MonkeyPatch, *readings: Times) -> None:
    queue = list(readings)
    monkeypatch.setattr(host_cpu.psutil, "cpu_times", lambda: queue.pop(0))


def test_the_busy_share_counts_idle_and_io_wait_as_idle_and_guests_once(monkeypatch):
    _counters(
        monkeypatch,
        Times(100.0, 0.0, 20.0, 50.0, 5.0, 3.0, 0.0),
        # 10 s of two CPUs (20 CPU-s): 12 busy (user 9 with 1 of guest, system 3), 8 idle
        Times(109.0, 0.0, 23.0, 56.0, 7.0, 4.0, 0.0),
    )
    since = host_cpu.mark()
    assert since is not None and since.busy_s == pytest.approx(120.0)
    assert host_cpu.busy_share(since) == pytest.approx(12.0 / 20.0)


def test_no_mark_no_time_or_unreadable_counters_say_nothing(monkeypatch):
    same = Times(1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0)
    _counters(monkeypatch, same, same)
    assert host_cpu.busy_share(host_cpu.mark()) is None  # no time counted since
    assert host_cpu.busy_share(None) is None

    def unreadable() -> Times:
        raise OSError("no /proc")

    monkeypatch.setattr(host_cpu.psutil, "cpu_times", unreadable)
    assert host_cpu.mark() is None
    assert host_cpu.busy_share(host_cpu.CpuMark(1.0, 2.0)) is None


def test_the_real_counters_give_a_share_between_nothing_and_everything():
    since = host_cpu.mark()
    assert since is not None and 0 <= since.busy_s <= since.total_s
    sum(i * i for i in range(300_000))  # some CPU time counted on the host
    share = host_cpu.busy_share(since)
    assert share is None or 0.0 <= share <= 1.0
