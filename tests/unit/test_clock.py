"""The retries' ETA on Redis's clock (app/worker/clock.py): the offset of a host's
clock, and an ETA read back in a skewed host's frame."""

from __future__ import annotations

import datetime as dt

import pytest

from batchgen.worker import clock


def test_the_offset_is_taken_at_the_round_trips_midpoint():
    assert clock.offset_from(1000.0, 700.0, 1000.2) == pytest.approx(300.1)
    assert clock.offset_from(50.0, 60.0, 50.0) == pytest.approx(-10.0)


def test_an_eta_is_read_in_the_hosts_frame(monkeypatch):
    """A host 300 s ahead of Redis waits for the same moment: its own clock must read
    the ETA plus 300 s."""
    monkeypatch.setattr(clock, "redis_offset_s", lambda: 300.0)
    monkeypatch.setattr(clock, "_broker_is_amqp", lambda app: False)
    request = object.__new__(clock.RedisClockRequest)
    request._app = None  # the broker check is stubbed above
    due = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    request._eta = due
    assert request.eta == due + dt.timedelta(seconds=300)
    request._eta = None
    assert request.eta is None
    # RabbitMQ holds the delay itself: its ETA is left as it is.
    monkeypatch.setattr(clock, "_broker_is_amqp", lambda app: True)
    request._eta = due
    assert request.eta == due


def test_the_offset_is_read_without_waiting_for_redis(monkeypatch):
    """Celery's consumer thread reads it: a Redis that hangs must not hold it up."""
    import threading

    release = threading.Event()

    class Hanging:
        def time(self):  # type: ignore[no-untyped-def]
            release.wait(5)
            return (1000, 0)

    monkeypatch.setattr("batchgen.limits.backend.get_redis", lambda: Hanging())
    monkeypatch.setattr(clock, "_measured_at", None)
    monkeypatch.setattr(clock, "_measuring", False)
    monkeypatch.setattr(clock, "_offset_s", 0.0)
    assert clock.redis_offset_s() == 0.0  # at once, the reading goes on in a thread
    release.set()
    for _ in range(100):
        if clock._measured_at is not None:
            break
        threading.Event().wait(0.02)
    assert clock.redis_offset_s() > 0  # this host's clock is far past Redis's 1000 s
