"""Synchronous calls: the deadline, the fail-fast rule, the errors and the streams (pure)."""

from __future__ import annotations

import json

import pytest

from batchgen.domain.formats.call_rules import (
    anthropic_stream,
    as_line,
    call_deadline_s,
    call_error,
    expected_wait_s,
    openai_stream,
    refuse_after_s,
)
from batchgen.errors import ValidationFailed


def test_the_deadline_is_the_callers_first_then_the_sdks_bounded_by_the_setting():
    headers = {"x-request-timeout": "30", "x-stainless-read-timeout": "600"}
    assert call_deadline_s(5, headers, 120, 300) == 30
    assert call_deadline_s(5, {"x-stainless-read-timeout": "45.5"}, 120, 300) == 45.5
    assert call_deadline_s("2m", {}, 120, 300) == 120
    assert call_deadline_s(None, {}, 120, 300) == 120
    assert call_deadline_s(None, {"x-request-timeout": "3600"}, 120, 300) == 300
    with pytest.raises(ValidationFailed):
        call_deadline_s(None, {"x-request-timeout": "soon"}, 120, 300)


def test_fail_fast_refuses_only_when_the_wait_uses_up_the_deadline():
    wait = expected_wait_s(ahead_tokens=60_000, tokens_per_min=60_000, cooldown_s=2.0)
    assert wait == 62.0
    assert refuse_after_s(wait, deadline_s=120) is None
    assert refuse_after_s(wait, deadline_s=30) == 62
    assert refuse_after_s(0.2, deadline_s=0.1) == 1  # Retry-After is whole seconds, ≥ 1


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("rate_limited", 429),
        ("expired", 504),
        ("context_length_exceeded", 400),
        ("permanent", 502),
        (None, 502),
    ],
)
def test_a_call_without_an_answer_maps_to_a_status(code, status):
    assert call_error(code, "why").status_code == status


def test_a_streamed_request_is_stored_without_its_stream_fields():
    line, stream, usage = as_line(
        {
            "model": "m",
            "messages": [],
            "stream": True,
            "stream_options": {"include_usage": True},
            "timeout": 5,
        }
    )
    assert (stream, usage) == (True, True)
    assert line["body"] == {"model": "m", "messages": []}


COMPLETION = {
    "id": "c1",
    "created": 1,
    "model": "m",
    "choices": [{"message": {"content": "Hello there."}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}


def _events(stream: bytes) -> list[str]:
    return [part for part in stream.decode().split("\n\n") if part]


def test_the_openai_stream_carries_the_text_the_finish_reason_usage_and_done():
    events = _events(b"".join(openai_stream(COMPLETION, include_usage=True)))
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        == "Hello there."
    )
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1]["usage"] == COMPLETION["usage"] and events[-1] == "data: [DONE]"


def test_the_anthropic_stream_is_the_messages_event_sequence():
    message = {
        "id": "m1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "Hi."}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 4, "output_tokens": 2},
    }
    events = _events(b"".join(anthropic_stream(message)))
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    delta = json.loads(events[2].split("\n")[1].removeprefix("data: "))
    assert delta["delta"] == {"type": "text_delta", "text": "Hi."}


def test_a_calls_end_wakes_every_request_waiting_on_it():
    """An Idempotency-Key's replay waits on the call beside its first caller: the end
    wakes both, and the replay forgetting it leaves the caller's wait in place."""
    import threading

    from batchgen.store.call_rows import CallWaiter

    waiter = CallWaiter("postgresql://127.0.0.1:1/none")  # nothing listens: no database
    try:
        caller, replay = threading.Event(), threading.Event()
        waiter.register(7, ready_timeout_s=0, event=caller)
        waiter.register(7, ready_timeout_s=0, event=replay)
        waiter._wake("7")
        assert caller.is_set() and replay.is_set()
        caller.clear()
        waiter.forget(7, replay)
        waiter._wake("7")
        assert caller.is_set()
        waiter.forget(7)
        caller.clear()
        waiter._wake("7")
        assert not caller.is_set()
    finally:
        waiter.close()


@pytest.mark.parametrize(
    ("status", "code", "replays"),
    [
        ("running", None, True),
        ("pending", None, True),
        ("succeeded", None, True),
        ("failed", "context_length_exceeded", True),
        ("failed", "rate_limited", False),
        ("failed", "upstream_error", False),
        ("failed", None, False),
        ("expired", "expired", False),
        ("cancelled", "cancelled", False),
    ],
)
def test_a_key_replays_only_an_open_call_or_one_the_request_ended(status, code, replays):
    from batchgen.domain.formats.call_rules import key_replays
    from batchgen.domain.lifecycle.status import ItemStatus

    assert key_replays(ItemStatus(status), code) is replays
