"""Deterministic simulator text, fault choice and wire-format helpers."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.domain.formats.tokens import count_text, get_encoding
from batchgen.simulator import formats
from batchgen.simulator import text as text_module
from batchgen.simulator.faults import FaultInjector
from batchgen.simulator.formats import BadRequest, go_duration, parse_anthropic, parse_openai
from batchgen.simulator.sim_config import SimulatorConfig
from batchgen.simulator.text import (
    VOCABULARY,
    completion_text,
    natural_length,
    request_digest,
    split_chunks,
)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü"}]


def test_digest_is_canonical_json_sha256() -> None:
    canonical = json.dumps(MESSAGES, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert request_digest(MESSAGES) == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    reordered = [{"content": m["content"], "role": m["role"]} for m in MESSAGES]
    assert request_digest(reordered) == request_digest(MESSAGES)


def test_completion_is_deterministic_and_counted() -> None:
    text, tokens, finish = completion_text(MESSAGES, 1000)
    assert (text, tokens, finish) == completion_text(list(MESSAGES), 1000)
    assert text.startswith(f"[{request_digest(MESSAGES)}] ")
    assert finish == "stop"
    assert tokens == count_text(text, "cl100k_base")
    assert 20 - 2 <= tokens <= natural_length(request_digest(MESSAGES)) <= 120
    assert "Be brief" not in text and "Hi" not in text


@settings(max_examples=60, deadline=None)
@given(content=st.text(max_size=40), max_tokens=st.integers(1, 140))
def test_truncation_respects_max_tokens(content: str, max_tokens: int) -> None:
    messages = [{"role": "user", "content": content}]
    text, tokens, finish = completion_text(messages, max_tokens)
    assert tokens == count_text(text, "cl100k_base") <= max_tokens
    natural = natural_length(request_digest(messages))
    assert finish == ("length" if max_tokens < natural else "stop")
    full, _, _ = completion_text(messages, 1000)
    assert full.startswith(text)
    if finish == "length" and max_tokens >= 12:
        assert tokens == max_tokens  # whole words are single tokens


def test_vocabulary_words_are_single_tokens() -> None:
    enc = get_encoding("cl100k_base")
    assert enc is not None
    assert all(len(enc.encode(" " + w)) == 1 for w in VOCABULARY)


def test_split_chunks_round_trips() -> None:
    text, _, _ = completion_text(MESSAGES, 1000)
    chunks = split_chunks(text)
    assert "".join(chunks) == text and len(chunks) > 3
    assert split_chunks("") == [""]
    assert "".join(split_chunks("[abc] ")) == "[abc] "


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0, "0s"),
        (0.12, "120ms"),
        (0.0001, "1ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (360, "6m0s"),
        (90.25, "1m30.25s"),
        (3725, "1h2m5s"),
    ],
)
def test_go_duration(seconds: float, expected: str) -> None:
    assert go_duration(seconds) == expected


def test_fault_injector_is_seeded_and_overridable() -> None:
    a = FaultInjector(0.5, ("5xx", "reset"), seed=7)
    b = FaultInjector(0.5, ("5xx", "reset"), seed=7)
    draws = [a.choose() for _ in range(200)]
    assert draws == [b.choose() for _ in range(200)]
    assert {None, "5xx", "reset"} == set(draws)
    assert FaultInjector(0.0, ("5xx",)).choose("hang") == "hang"
    assert FaultInjector(1.0, ("5xx",)).choose("none") is None
    with pytest.raises(ValueError):
        a.choose("explode")


def test_parsers_reject_bad_bodies() -> None:
    with pytest.raises(BadRequest):
        parse_openai({"model": "m"}, 100)
    with pytest.raises(BadRequest):
        parse_openai({"model": "m", "messages": [{"role": "user"}], "max_tokens": 0}, 100)
    with pytest.raises(BadRequest):
        parse_anthropic({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(BadRequest):
        parse_anthropic(
            {"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}
        )
    req = parse_openai(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        100,
    )
    assert (req.max_tokens, req.stream, req.include_usage) == (7, True, True)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        SimulatorConfig(fault_kinds=("boom",))
    with pytest.raises(ValueError):
        SimulatorConfig(charge_mode="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SimulatorConfig().updated({"seed": 3})
    assert SimulatorConfig().updated({"tokens_per_min": 5}).tokens_per_min == 5


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), max_tokens=st.integers(1, 140))
def test_counting_by_sums_finds_what_counting_whole_texts_finds(seed: int, max_tokens: int) -> None:
    """The simulator cuts its answer by summing the tokens of each word; the texts are
    the ones a search counting each candidate whole finds."""
    digest = f"{seed:016x}"
    rng = random.Random(digest)
    words = [rng.choice(VOCABULARY) + rng.choice(("", "", "", ".")) for _ in range(120)]
    prefix = f"[{digest}] "
    budget = max(max_tokens, count_text(prefix, "cl100k_base"))
    by_sums = text_module._longest_within(prefix, words, budget, "cl100k_base")
    assert by_sums == text_module._search_longest(prefix, words, budget, "cl100k_base")
    assert count_text(by_sums, "cl100k_base") <= budget


def test_delta_events_render_the_chunk_as_sse_would() -> None:
    render = formats.openai_delta_events("chatcmpl-1", "sim-gpt", include_usage=True)
    for piece in ("", " plain words", ' "quoted" \\ ü\n', "\x00"):
        chunk = formats.openai_chunk("chatcmpl-1", "sim-gpt", {"content": piece}, None, True)
        expected = formats.sse("openai", "", chunk)
        # the same bytes but for "created", which the template fixes once per stream
        assert json.loads(render(piece)[6:]) | {"created": 0} == json.loads(expected[6:]) | {
            "created": 0
        }
        assert render(piece).startswith(b"data: ") and render(piece).endswith(b"\n\n")
