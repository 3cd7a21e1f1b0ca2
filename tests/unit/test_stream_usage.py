"""The provider's usage read from a streamed call's chunks as they come
(app/domain/formats/stream_usage.py), in the forms the relay passes on."""

from __future__ import annotations

from batchgen.domain.billing.cost import usage_of
from batchgen.domain.formats.stream_usage import ReportedUsage, StreamUsage
from batchgen.providers.anthropic import ChatChunks


def _first(chunks: list[dict]) -> tuple[int, ReportedUsage | None]:
    """The index of the chunk that completed the usage, and that usage."""
    stream = StreamUsage()
    for index, chunk in enumerate(chunks):
        usage = stream.add(chunk)
        if usage is not None:
            return index, usage
    return -1, None


def test_an_openai_stream_reports_its_usage_in_its_last_chunk():
    head = {"id": "c", "object": "chat.completion.chunk", "usage": None}
    usage = {
        "prompt_tokens": 40,
        "completion_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    chunks = [
        {**head, "choices": [{"index": 0, "delta": {"content": "hi"}}]},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**head, "choices": [], "usage": usage},
    ]
    index, got = _first(chunks)
    assert index == 2 and got is not None
    assert (got.prompt_tokens, got.completion_tokens) == (40, 9)
    assert usage_of(got.prompt_tokens, got.completion_tokens, got.body).cached_tokens == 32


def test_an_anthropic_stream_reports_input_at_its_start_and_output_at_its_end():
    events = [
        {
            "type": "message_start",
            "message": {"usage": {"input_tokens": 5, "cache_read_input_tokens": 20}},
        },
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "hi"}},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 4},
        },
        {"type": "message_stop"},
    ]
    index, got = _first(events)
    assert index == 2 and got is not None
    assert (got.prompt_tokens, got.completion_tokens) == (25, 4)
    assert usage_of(25, 4, got.body).cached_tokens == 20


def test_anthropic_events_relayed_as_chat_chunks_report_their_usage_too():
    chat = ChatChunks("sim-claude", 0)
    end = {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn"},
        "usage": {"output_tokens": 6},
    }
    chunks = chat.of({"type": "message_start", "message": {"id": "m"}}, 11, {}) + chat.of(
        end, 11, {}
    )
    _, got = _first(chunks)
    assert got is not None and (got.prompt_tokens, got.completion_tokens) == (11, 6)


def test_a_stream_cut_before_its_usage_reports_none():
    head = {"id": "c", "object": "chat.completion.chunk", "usage": None}
    assert _first([{**head, "choices": [{"index": 0, "delta": {"content": "h"}}]}]) == (-1, None)


def test_a_reported_usage_round_trips_through_json():
    usage = ReportedUsage(3, 4, {"usage": {"prompt_tokens": 3, "completion_tokens": 4}})
    assert ReportedUsage.from_json(usage.to_json()) == usage
