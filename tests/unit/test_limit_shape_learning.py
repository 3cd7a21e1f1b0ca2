"""The limiter's shape learned from the provider's reset headers (pure):
app/domain/scheduling/rate_limits.py reset_evidence, shape_evidence, next_shape, and the headers'
limits they read."""

from __future__ import annotations

import datetime as dt

from hypothesis import given
from hypothesis import strategies as st

from batchgen.domain.scheduling.rate_limits import (
    BUCKET,
    SHAPE_RESET_SLACK_S,
    WINDOW,
    RateLimitState,
    bucket_reset_s,
    next_shape,
    reset_evidence,
    shape_evidence,
)
from batchgen.providers.headers import anthropic_rate_limits, openai_rate_limits

WINDOW_S = 60.0


def test_a_bucket_resets_in_proportion_to_what_is_used():
    assert bucket_reset_s(1000, 1000, WINDOW_S) == 0.0
    assert bucket_reset_s(1000, 750, WINDOW_S) == 15.0
    assert bucket_reset_s(1000, 0, WINDOW_S) == 60.0


def test_a_reset_a_bucket_would_send_is_a_buckets():
    # OpenAI's documented example: 150000 limit, 149984 left, reset "6ms".
    assert reset_evidence(150_000, 149_984, 0.006, WINDOW_S) == BUCKET
    assert reset_evidence(1000, 500, 30.0, WINDOW_S) == BUCKET


def test_a_sliding_window_just_charged_is_a_windows():
    # Whatever is used, its charges age out a window after the newest.
    assert reset_evidence(1000, 990, 60.0, WINDOW_S) == WINDOW
    assert reset_evidence(1000, 500, 59.9, WINDOW_S) == WINDOW


def test_a_fixed_window_resetting_early_is_a_windows():
    # Most of the limit used, the window ends in 5 s: a bucket would need 54 s.
    assert reset_evidence(1000, 100, 5.0, WINDOW_S) == WINDOW


def test_a_nearly_empty_limiter_says_nothing_of_its_shape():
    # A bucket almost empty and a sliding window just charged both read ~60 s.
    assert reset_evidence(1000, 5, 59.7, WINDOW_S) is None


def test_a_missing_part_says_nothing():
    assert reset_evidence(None, 10, 1.0, WINDOW_S) is None
    assert reset_evidence(1000, None, 1.0, WINDOW_S) is None
    assert reset_evidence(1000, 10, None, WINDOW_S) is None
    assert reset_evidence(0, 0, 1.0, WINDOW_S) is None
    assert reset_evidence(1000, 10, float("nan"), WINDOW_S) is None


def test_the_requests_header_speaks_when_the_tokens_one_does_not():
    state = RateLimitState(
        remaining_tokens=5,
        limit_tokens=1000,
        reset_tokens_s=59.7,  # says nothing
        remaining_requests=99,
        limit_requests=100,
        reset_requests_s=60.0,  # a bucket would need 0.6 s
    )
    assert shape_evidence(state, WINDOW_S) == WINDOW
    assert shape_evidence(None, WINDOW_S) is None
    assert shape_evidence(RateLimitState(remaining_tokens=5), WINDOW_S) is None


@given(
    limit=st.integers(1, 10_000_000),
    used_share=st.floats(0, 1),
    window_s=st.sampled_from([10.0, 60.0]),
    error_s=st.floats(-SHAPE_RESET_SLACK_S, SHAPE_RESET_SLACK_S),
)
def test_a_bucket_is_never_taken_for_a_window(limit, used_share, window_s, error_s):
    """Whatever it holds, a true bucket's header (rounded or skewed by up to the slack)
    never says window."""
    remaining = int(limit * (1 - used_share))
    reset = max(0.0, bucket_reset_s(limit, remaining, window_s) + error_s)
    assert reset_evidence(limit, remaining, reset, window_s) in (BUCKET, None)


@given(
    limit=st.integers(100, 10_000_000),
    used_share=st.floats(0, 0.6),
    since_newest_s=st.floats(0, 1.0),
)
def test_a_sliding_window_in_use_is_never_taken_for_a_bucket(limit, used_share, since_newest_s):
    """A sliding window whose newest charge is recent, with room left, reads as one."""
    remaining = int(limit * (1 - used_share))
    assert reset_evidence(limit, remaining, WINDOW_S - since_newest_s, WINDOW_S) == WINDOW


def test_the_shape_switches_after_samples_in_a_row_against_it():
    shape, n = BUCKET, 0
    for expected in [(BUCKET, 1), (BUCKET, 2), (WINDOW, 0)]:
        shape, n = next_shape(shape, n, WINDOW, 3)
        assert (shape, n) == expected
    assert next_shape(WINDOW, 0, None, 3) == (WINDOW, 0)  # nothing said, nothing changes
    assert next_shape(WINDOW, 2, WINDOW, 3) == (WINDOW, 0)  # one for it resets the count


@given(
    evidence=st.lists(st.sampled_from([WINDOW, BUCKET, None]), max_size=40),
    switch_after=st.integers(1, 5),
)
def test_one_odd_header_never_switches_the_shape(evidence, switch_after):
    """The shape changes only after switch_after headers in a row against it, each
    one a header for the new shape."""
    shape, n = BUCKET, 0
    against = 0
    for e in evidence:
        before = shape
        shape, n = next_shape(shape, n, e, switch_after)
        if e is not None:
            against = against + 1 if e != before else 0
        if shape != before:
            assert e == shape and against >= switch_after
            against = 0
        assert 0 <= n < switch_after


def test_the_headers_carry_the_providers_limits():
    openai = openai_rate_limits(
        {
            "x-ratelimit-limit-tokens": "150000",
            "x-ratelimit-remaining-tokens": "149984",
            "x-ratelimit-reset-tokens": "6ms",
            "x-ratelimit-limit-requests": "500",
        }
    )
    assert (openai.limit_tokens, openai.limit_requests) == (150_000, 500)
    assert shape_evidence(openai, WINDOW_S) == BUCKET
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    anthropic = anthropic_rate_limits(
        {
            "anthropic-ratelimit-tokens-limit": "80000",
            "anthropic-ratelimit-tokens-remaining": "40000",
            "anthropic-ratelimit-tokens-reset": "2026-01-01T00:00:30Z",
        },
        now=now,
    )
    assert anthropic.limit_tokens == 80_000
    assert shape_evidence(anthropic, WINDOW_S) == BUCKET
