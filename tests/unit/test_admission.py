"""Validation of batch input lines (pure, no services)."""

from __future__ import annotations

import json

import pytest

from batchgen.domain.formats import tokens
from batchgen.domain.formats.admission import (
    Limits,
    binding_tokens_per_min,
    never_fits,
    parse_lines,
)
from batchgen.errors import PayloadTooLarge, ValidationFailed
from batchgen.registry import get_registry, parse_registry
from tests.unit import test_pools as pools

LIMITS = Limits(max_lines=100, max_bytes=1 << 20)


def line(custom_id="a", **body):
    b = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], **body}
    return (
        json.dumps(
            {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": b}
        ).encode()
        + b"\n"
    )


def parse(*lines, limits=LIMITS):
    return list(parse_lines(iter(lines), get_registry(), limits))


def test_valid_lines_get_token_estimates_once():
    drafts = parse(line("a", max_tokens=50), b"\n", line("b"))
    assert [d.custom_id for d in drafts] == ["a", "b"]
    assert [d.line_no for d in drafts] == [1, 3]  # blank lines keep their numbers
    assert drafts[0].max_tokens == 50
    assert drafts[1].max_tokens == get_registry()["sim-small"].max_output_tokens
    expected = tokens.count_messages([{"role": "user", "content": "hi"}], "cl100k_base")
    assert drafts[0].prompt_tokens_est == expected


@pytest.mark.parametrize(
    ("lines", "field", "line_no"),
    [
        ((line("a"), b"[1,2]"), None, 2),
        ((line("a"), line("a")), "custom_id", 2),
        ((line("a", max_tokens=True),), "body.max_tokens", 1),
        ((line("a", max_completion_tokens=-1),), "body.max_completion_tokens", 1),
        ((line("a", stream=True),), "body.stream", 1),
        ((line("a", messages=[]),), "body.messages", 1),
        ((line("a", messages=[{"content": "x"}]),), "body.messages[0].role", 1),
    ],
)
def test_errors_name_line_and_field(lines, field, line_no):
    with pytest.raises(ValidationFailed) as info:
        parse(*lines)
    assert info.value.line == line_no
    assert info.value.field == field


def test_limits():
    with pytest.raises(PayloadTooLarge):
        parse(line("a"), line("b"), limits=Limits(max_lines=1, max_bytes=1 << 20))
    with pytest.raises(PayloadTooLarge):
        parse(line("a"), limits=Limits(max_lines=10, max_bytes=10))


def test_parse_is_lazy_so_big_files_stream():
    seen = []

    def lines():
        for i in range(10**6):
            seen.append(i)
            yield line(f"id{i}")

    gen = parse_lines(lines(), get_registry(), Limits(10**7, 1 << 40))
    next(gen)
    assert len(seen) == 1


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("max_completion_tokens", "max_tokens"),
        ("max_tokens", "max_completion_tokens"),
    ],
)
def test_both_token_fields_are_checked(first, second):
    limit = get_registry()["sim-small"].max_output_tokens
    for bad, field in ((limit + 1, second), (0, second), ("9", second)):
        with pytest.raises(ValidationFailed) as info:
            parse(line("a", **{first: 10, second: bad}))
        assert info.value.field == f"body.{field}"


def test_the_larger_token_field_is_reserved():
    """Providers differ on which field wins; the reservation covers either."""
    (small_first,) = parse(line("a", max_completion_tokens=10, max_tokens=700))
    (large_first,) = parse(line("a", max_completion_tokens=700, max_tokens=10))
    assert small_first.max_tokens == large_first.max_tokens == 700


def test_n_choices_reserve_n_times_the_output():
    (one,) = parse(line("a", max_tokens=100))
    (three,) = parse(line("a", max_tokens=100, n=3))
    (default,) = parse(line("a", n=2))
    assert one.max_tokens == 100
    assert three.max_tokens == 300
    assert default.max_tokens == 2 * get_registry()["sim-small"].max_output_tokens
    assert three.prompt_tokens_est == one.prompt_tokens_est


def test_n_choices_fit_the_context_window_one_at_a_time():
    """The window holds the prompt and one choice: n does not multiply it."""
    spec = get_registry()["sim-small"]
    (draft,) = parse(line("a", max_tokens=spec.max_output_tokens, n=32))
    assert draft.max_tokens == 32 * spec.max_output_tokens > spec.context_window


@pytest.mark.parametrize("n", [0, -1, 129, 1.5, True, "2"])
def test_bad_n_is_refused(n):
    with pytest.raises(ValidationFailed) as info:
        parse(line("a", n=n))
    assert info.value.field == "body.n"


def test_offline_rows_ask_one_choice_its_own_bound():
    from batchgen.domain.formats.admission import per_choice_max_tokens

    (draft,) = parse(line("a", max_tokens=100, n=3))
    assert per_choice_max_tokens(draft.body, draft.max_tokens) == 100


def test_the_smaller_of_the_tenants_and_the_models_limit_binds():
    """A request runs on one deployment: a pool's largest one bounds it, not the sum."""
    spec = parse_registry(pools.MODEL + pools.POOL)["m"]  # deployments of 1000 and 500
    assert spec.tokens_per_min == 1500
    assert binding_tokens_per_min(spec, None) == (
        1000,
        "the tokens_per_min of m's largest deployment 'a'",
    )
    assert binding_tokens_per_min(spec, 5000)[0] == 1000
    assert binding_tokens_per_min(spec, 800) == (800, "the tenant's tokens_per_min")
    assert never_fits(1000, spec, None) is None
    assert never_fits(1001, spec, None) == (
        "a request of 1001 tokens (the prompt plus max_tokens times n) can never fit "
        "the tokens_per_min of m's largest deployment 'a' of 1000"
    )
    assert "the tenant's tokens_per_min of 800" in (never_fits(801, spec, 800) or "")
    lone = parse_registry(pools.ONE)["m"]
    assert never_fits(101, lone, None) == (
        "a request of 101 tokens (the prompt plus max_tokens times n) can never fit "
        "the tokens_per_min of m of 100"
    )
