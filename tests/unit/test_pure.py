"""Pure domain functions: retry timing, cost, status moves, deadlines, header parsing."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import random
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.domain.billing.cost import cost_usd
from batchgen.domain.lifecycle import retry
from batchgen.domain.lifecycle.deadlines import call_timeout_s, parse_duration_s
from batchgen.domain.lifecycle.status import BatchStatus, ItemStatus, batch_status
from batchgen.errors import ValidationFailed
from batchgen.providers.headers import (
    anthropic_rate_limits,
    openai_rate_limits,
    parse_openai_duration_s,
)
from batchgen.registry import get_registry


def test_retry_after_headers_are_parsed():
    assert retry.parse_retry_after_s({"retry-after-ms": "1500"}) == 1.5
    assert retry.parse_retry_after_s({"Retry-After": "7"}) == 7.0
    assert (
        retry.parse_retry_after_s(
            {"retry-after": "Sun, 29 Nov 2026 10:00:10 GMT"},
            now_s=dt.datetime(2026, 11, 29, 10, 0, 0, tzinfo=dt.UTC).timestamp(),
        )
        == 10.0
    )
    assert retry.parse_retry_after_s({}) is None


@given(attempt=st.integers(1, 30), seed=st.integers(0, 2**32))
def test_backoff_is_full_jitter_under_the_cap(attempt, seed):
    wait = retry.backoff_s(attempt, rng=random.Random(seed), initial_s=0.5, max_s=30)
    assert 0 <= wait <= min(30, 0.5 * 2 ** (attempt - 1))


def test_backoff_honours_retry_after_up_to_the_cap():
    rng = random.Random(1)
    assert 4.0 <= retry.backoff_s(1, retry_after_s=4.0, rng=rng) <= 4.4
    # an absurd retry-after is capped
    capped = retry.backoff_s(1, retry_after_s=10_000, rng=rng, initial_s=0.5)
    assert retry.MAX_RETRY_AFTER_S <= capped <= 1.1 * retry.MAX_RETRY_AFTER_S
    assert retry.fits_deadline(5, 10) and not retry.fits_deadline(9.5, 10)


def test_cost_is_exact_decimal_from_registry_prices():
    spec = get_registry()["sim-small"]  # $0.15 in, $0.60 out per 1M
    assert cost_usd(1_000_000, 0, spec) == Decimal("0.15")
    assert cost_usd(1234, 567, spec) == Decimal("0.0001851") + Decimal("0.0003402")


def test_batch_status_from_item_counts():
    assert batch_status({ItemStatus.RUNNING: 1}, False) is BatchStatus.IN_PROGRESS
    assert batch_status({ItemStatus.RUNNING: 1}, True) is BatchStatus.CANCELLING
    assert batch_status({}, True) is BatchStatus.CANCELLED
    assert batch_status({ItemStatus.SUCCEEDED: 3}, False) is BatchStatus.COMPLETED
    assert batch_status({ItemStatus.EXPIRED: 2}, False) is BatchStatus.EXPIRED
    assert batch_status({ItemStatus.EXPIRED: 2, ItemStatus.FAILED: 1}, False) is (
        BatchStatus.COMPLETED
    )


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("24h", 86400), ("30m", 1800), ("90s", 90), ("2d", 172800), ("500ms", 0.5), (60, 60)],
)
def test_durations(text, seconds):
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize("text", ["soon", "-1h", "0s", "9d", True])
def test_bad_durations(text):
    with pytest.raises(ValidationFailed):
        parse_duration_s(text)


def test_call_timeout_never_passes_the_deadline():
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    assert call_timeout_s(120, now + dt.timedelta(seconds=30), now) == 30
    assert call_timeout_s(10, now + dt.timedelta(seconds=30), now) == 10
    assert call_timeout_s(10, now - dt.timedelta(seconds=1), now) == 0


def test_rate_limit_headers():
    assert parse_openai_duration_s("6m0s") == 360
    assert parse_openai_duration_s("1h2m3.5s") == 3723.5
    assert parse_openai_duration_s("120ms") == pytest.approx(0.12)
    state = openai_rate_limits(
        {
            "x-ratelimit-remaining-tokens": "5000",
            "x-ratelimit-reset-tokens": "1s",
            "x-ratelimit-remaining-requests": "9",
        }
    )
    assert (state.remaining_tokens, state.reset_tokens_s, state.remaining_requests) == (5000, 1, 9)
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    a = anthropic_rate_limits(
        {
            "anthropic-ratelimit-tokens-remaining": "42",
            "anthropic-ratelimit-tokens-reset": "2026-01-01T00:00:05Z",
        },
        now,
    )
    assert (a.remaining_tokens, a.reset_tokens_s) == (42, 5)


# -- the message's ticket ---------------------------------------------------------------


def test_ticket_round_trips_through_a_message_and_refuses_anything_else():
    from batchgen.store.items import Ticket

    ticket = Ticket(
        item_id=7,
        batch_id="batch_x",
        tenant_id=3,
        attempt=2,
        prompt_tokens_est=120,
        max_tokens=64,
        tenant_tokens_per_min=None,
    )
    message = json.loads(json.dumps(ticket.to_message()))
    assert Ticket.from_message(7, message) == ticket
    assert "item_id" not in message  # the id is the task's argument
    assert "urgent" not in message  # only a call's message says so
    call = dataclasses.replace(ticket, urgent=True, tenant_name="acme")
    assert Ticket.from_message(7, json.loads(json.dumps(call.to_message()))) == call
    assert call.to_message()["tenant_name"] == "acme"
    for broken in ({}, {**message, "attempt": "two"}, {**message, "tenant": None}):
        with pytest.raises(ValueError, match="not a ticket"):
            Ticket.from_message(7, broken)


def test_the_tick_tasks_lines_are_dropped_and_every_other_tasks_kept():
    import logging

    from batchgen.logs import TickLogFilter

    def record(message: str, *args: object, level: int = logging.INFO) -> logging.LogRecord:
        return logging.LogRecord("celery.app.trace", level, __file__, 1, message, args, None)

    keep = TickLogFilter().filter
    assert not keep(record("Task %s[%s] received", "batchgen.dispatch", "abc"))
    assert not keep(record("Task batchgen.sweep[abc] succeeded in 0.01s: None"))
    assert keep(record("Task %s[%s] received", "batchgen.generate", "abc"))
    assert keep(record("Task batchgen.dispatch[abc] raised: boom", level=logging.ERROR))


def test_the_batchgen_names_win_over_the_conventional_ones(monkeypatch):
    """A 12-factor host sets DATABASE_URL for its own database: BATCHGEN_DATABASE_URL
    (a Django setting exported to the environment) is the one batchgen uses."""
    from batchgen.config import Settings

    monkeypatch.setenv("DATABASE_URL", "postgresql://site/site")
    monkeypatch.setenv("REDIS_URL", "redis://site:6379/0")
    assert Settings().database.url == "postgresql://site/site"
    monkeypatch.setenv("BATCHGEN_DATABASE_URL", "postgresql://ours/batchgen")
    monkeypatch.setenv("BATCHGEN_REDIS_URL", "redis://ours:6379/1")
    settings = Settings()
    assert (settings.database.url, settings.redis.url) == (
        "postgresql://ours/batchgen",
        "redis://ours:6379/1",
    )
