"""The suite's waits (tests/waiting.py): how often a condition is asked."""

from __future__ import annotations

import pytest

from tests import waiting


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now_s += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(waiting.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(waiting.time, "sleep", fake.sleep)
    return fake


def test_an_unnamed_interval_starts_short_and_grows_to_its_cap(clock: FakeClock):
    asked: list[float] = []

    def never() -> bool:
        asked.append(clock.now_s)
        return False

    assert waiting.poll_until(never, timeout_s=10) is False
    assert clock.sleeps[0] == waiting.POLL_FIRST_S
    assert clock.sleeps == sorted(clock.sleeps)  # never shorter than the last
    assert max(clock.sleeps) == waiting.POLL_MAX_S
    # Ten seconds: about four times a second once grown (a fixed 0.1 s asked 100 times).
    assert len(asked) <= 10 / waiting.POLL_MAX_S + 10
    assert asked[-1] > 10  # asked once more past the deadline, then gave up


def test_a_named_interval_stays_fixed(clock: FakeClock):
    calls = iter([False, False, False, "done"])
    assert waiting.poll_until(lambda: next(calls), timeout_s=10, poll_s=0.05) == "done"
    assert clock.sleeps == [0.05, 0.05, 0.05]


def test_a_condition_met_at_once_is_not_slept_on(clock: FakeClock):
    assert waiting.wait_until(lambda: 1, timeout_s=1, what="one") == 1
    assert clock.sleeps == []


def test_a_wait_that_times_out_names_what_it_awaited(clock: FakeClock):
    with pytest.raises(AssertionError, match="timed out after 1s waiting for the sun"):
        waiting.wait_until(lambda: 0, timeout_s=1, what=lambda: "the sun")
