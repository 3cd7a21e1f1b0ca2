"""Error classification of the provider adapters, and the parameters of the request
they send (pure parts; the HTTP side is in tests/integration/test_providers.py)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from batchgen.errors import (
    CallCancelled,
    ContextLengthExceeded,
    MalformedResponse,
    PermanentProviderError,
    ProviderError,
    RateLimited,
    TransientProviderError,
)
from batchgen.providers import anthropic as anthropic_adapter
from batchgen.providers import openai as openai_adapter
from batchgen.providers.base import (
    Provider,
    ProviderRequest,
    StreamWatch,
    chat_params,
    classify_status,
    status_message,
    transport_error,
)
from batchgen.registry import ModelSpec, ProviderKind

REQUEST = httpx2.Request("POST", "http://provider.test/v1/chat/completions")


@pytest.mark.parametrize(
    ("status", "code", "text", "expected"),
    [
        (408, None, None, TransientProviderError),
        (409, None, None, TransientProviderError),
        (500, "server_error", None, TransientProviderError),
        (502, None, None, TransientProviderError),
        (503, None, None, TransientProviderError),
        (529, "overloaded_error", None, TransientProviderError),
        (400, None, "bad 'temperature'", PermanentProviderError),
        (401, "invalid_api_key", None, PermanentProviderError),
        (403, None, None, PermanentProviderError),
        (404, "model_not_found", None, PermanentProviderError),
        (413, "request_too_large", None, PermanentProviderError),
        (422, None, None, PermanentProviderError),
        (400, "context_length_exceeded", None, ContextLengthExceeded),
        (400, None, "This model's maximum context length is 8192 tokens.", ContextLengthExceeded),
        (400, "invalid_request_error", "prompt is too long: 9 > 8 maximum", ContextLengthExceeded),
        (400, None, "input exceeds the context window", ContextLengthExceeded),
    ],
)
def test_classify_status(
    status: int, code: str | None, text: str | None, expected: type[ProviderError]
) -> None:
    err = classify_status(status, f"HTTP {status}", {}, code, provider_message=text)
    assert type(err) is expected and err.status == status and err.message == f"HTTP {status}"
    assert not err.billed


@pytest.mark.parametrize(
    ("headers", "retry_after_s"),
    [
        ({"retry-after-ms": "1500", "retry-after": "2"}, 1.5),
        ({"Retry-After": "7"}, 7.0),
        ({}, None),
    ],
)
def test_rate_limited_carries_retry_after(headers: dict[str, str], retry_after_s: float) -> None:
    err = classify_status(429, "HTTP 429", headers, "rate_limit_exceeded")
    assert isinstance(err, RateLimited) and err.retry_after_s == retry_after_s


def test_status_message_has_identifiers_only() -> None:
    exc = RuntimeError("the prompt text")
    assert status_message(400, exc, "context_length_exceeded", "req_1") == (
        "HTTP 400 RuntimeError code=context_length_exceeded request_id=req_1"
    )
    assert status_message(500, exc, None, "has spaces in it") == "HTTP 500 RuntimeError"


def test_openai_status_error_keeps_no_provider_text() -> None:
    response = httpx2.Response(400, request=REQUEST, headers={"x-request-id": "req_9"})
    body = {"message": "maximum context length ... Describe a lamp", "code": None, "type": "x y"}
    err = openai_adapter.translate(openai.BadRequestError("m", response=response, body=body))
    assert type(err) is ContextLengthExceeded
    assert err.message == "HTTP 400 BadRequestError request_id=req_9"


def test_anthropic_error_event_in_a_stream() -> None:
    """``event: error`` inside a 200 stream: its type names the status; billed."""
    response = httpx2.Response(200, request=REQUEST)
    body = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    err = anthropic_adapter.translate(
        anthropic.APIStatusError("x", response=response, body=body), in_stream=True
    )
    assert type(err) is TransientProviderError and err.status == 529 and err.billed


def test_openai_error_event_in_a_stream() -> None:
    exc = openai.APIError("boom", REQUEST, body={"code": "server_error", "message": "boom"})
    err = openai_adapter.translate(exc, in_stream=True)
    assert type(err) is TransientProviderError and err.billed and "server_error" in err.message


@pytest.mark.parametrize("translate", [openai_adapter.translate, anthropic_adapter.translate])
def test_raw_decoding_and_transport_errors(translate: Callable[..., ProviderError]) -> None:
    malformed = translate(json.JSONDecodeError("Expecting value", '{"secret": ', 11))
    assert type(malformed) is MalformedResponse and "secret" not in malformed.message
    cut = translate(httpx2.RemoteProtocolError("peer closed"), in_stream=True)
    assert type(cut) is TransientProviderError and cut.billed
    assert cut.message == "connection error (RemoteProtocolError)"
    stalled = translate(httpx2.ReadTimeout("read"), in_stream=True)
    assert stalled.message.startswith("timeout") and stalled.billed


def test_connect_failures_are_not_billed() -> None:
    wrapped = openai.APIConnectionError(request=REQUEST)
    wrapped.__cause__ = httpx2.ConnectError("refused")
    assert not transport_error(wrapped).billed
    assert not transport_error(httpx2.ConnectTimeout("slow")).billed
    assert transport_error(httpx2.ReadTimeout("slow")).billed


def _request(timeout_s: float = 5.0) -> ProviderRequest:
    spec = ModelSpec(
        name="m",
        provider=ProviderKind.OPENAI,
        base_url="http://provider.test/v1",
        api_key_env="NO_KEY",
        group="g",
        budget_key="b",
        context_window=100,
        max_output_tokens=10,
        tokens_per_min=100,
        requests_per_min=10,
        max_concurrency=1,
        input_usd_per_1m=0,
        output_usd_per_1m=0,
    )
    return ProviderRequest(spec=spec, body={"messages": []}, timeout_s=timeout_s)


def test_stream_watch_cancel_and_deadline() -> None:
    request = _request()
    watch = StreamWatch(request)
    watch.add("hello world")
    watch.check()
    request.cancel.set()
    with pytest.raises(CallCancelled) as err:
        watch.check()
    assert err.value.billed and err.value.completion_tokens == 2
    assert "hello" not in err.value.message
    late = StreamWatch(_request(timeout_s=0.01), started=time.monotonic() - 1)
    with pytest.raises(TransientProviderError, match="timeout"):
        late.check()


@pytest.mark.parametrize(
    "provider", [openai_adapter.OpenAIProvider(), anthropic_adapter.AnthropicProvider()]
)
def test_cancelled_request_is_never_sent(provider: Provider) -> None:
    request = _request()
    request.cancel.set()
    with pytest.raises(CallCancelled) as err:
        provider.complete(request)
    assert not err.value.billed


# -- the request both adapters send (pure; over HTTP in tests/integration/test_providers.py)

BODY = {
    "model": "from-the-line",
    "messages": [
        {"role": "system", "content": "terse"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ],
    "max_tokens": 50,
    "temperature": 0.3,
    "stop": "END",
    "stream": False,
    "stream_options": {"include_usage": False},
    "seed": 4,
}


def _line(body: dict[str, Any]) -> ProviderRequest:
    return dataclasses.replace(
        _request(timeout_s=4.5), body=body, item_id=7, extra_headers={"x-sim-fault": "none"}
    )


def test_chat_params_sets_the_model_headers_and_timeout() -> None:
    params = chat_params(_line(BODY), {"messages": [], "model": "ignored"})
    assert params == {
        "messages": [],
        "model": "m",  # the registry's name, never the line's
        "extra_headers": {"x-batchgen-item": "7", "x-sim-fault": "none"},
        "timeout": 4.5,
    }


def test_openai_forwards_the_body_as_it_is() -> None:
    own = {"model": "m", "extra_headers": {"x-batchgen-item": "7", "x-sim-fault": "none"}}
    extra = {"max_tokens": 50, "temperature": 0.3, "stop": "END", "seed": 4}
    assert openai_adapter._params(_line(BODY)) == {
        **own,
        "messages": BODY["messages"],
        "extra_body": extra,
        "timeout": 4.5,
    }
    bare = {"model": "x", "messages": [], "stream": True}
    assert openai_adapter._params(_line(bare))["extra_body"] is None


def test_anthropic_translates_the_body_to_messages() -> None:
    assert anthropic_adapter._params(_line(BODY)) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "system": "terse",
        "max_tokens": 50,
        "stop_sequences": ["END"],
        "extra_body": {"temperature": 0.3},  # the SDK has no keyword for it
        "extra_headers": {"x-batchgen-item": "7", "x-sim-fault": "none"},
        "timeout": 4.5,
    }
    both = {"messages": [], "max_completion_tokens": 20, "max_tokens": 90}
    assert anthropic_adapter._params(_line(both))["max_tokens"] == 20
    neither = anthropic_adapter._params(_line({"messages": []}))
    assert neither["max_tokens"] == 10  # the registry's max_output_tokens


# -- reading a stream's events --------------------------------------------------------


def test_sse_data_reads_events_split_anywhere():
    """The data of each event, whatever the chunk boundaries and line endings; other
    fields and comments are skipped, and a last line without its end still counts."""
    from batchgen.providers.base import sse_data

    body = (
        b': keep-alive\n\nevent: message\ndata: {"a": 1}\n\n'
        b'data: {"b": 2}\r\n\r\ndata:{"c": 3}\r\rdata: [DONE]'
    )
    expected = [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}', b"[DONE]"]
    assert list(sse_data([body])) == expected
    for size in (1, 2, 3, 7, 16):  # every split, CRLF halves included
        chunks = [body[i : i + size] for i in range(0, len(body), size)]
        assert list(sse_data(chunks)) == expected, size
    assert list(sse_data([b"", b"data: x\n", b""])) == [b"x"]


def test_sse_events_read_names_and_data_split_anywhere():
    """Each event's name (None without one) and data (its data lines joined by LF),
    whatever the chunk boundaries and line endings (a CRLF split in two included);
    comments and other fields skipped; an event the body ends before its blank line is
    dropped, as the SDKs drop it (a stream cut there ends unfinished)."""
    from batchgen.providers.base import sse_events

    body = (
        b': keep-alive\n\nevent: message_start\r\ndata: {"a": 1}\r\n\r\n'
        b"event:ping\ndata: {}\n\nid: 7\ndata: line one\ndata: line two\n\n"
        b'event: error\rdata: {"e": 1}\r\revent: message_stop\ndata: {}'
    )
    expected = [
        (b"message_start", b'{"a": 1}'),
        (b"ping", b"{}"),
        (None, b"line one\nline two"),
        (b"error", b'{"e": 1}'),
    ]
    assert list(sse_events([body])) == expected
    for size in (1, 2, 3, 7, 16):  # every split, CRLF halves included
        chunks = [body[i : i + size] for i in range(0, len(body), size)]
        assert list(sse_events(chunks)) == expected, size
    assert list(sse_events([b"", b"event: a\r", b"\ndata: x\r\n\r\n"])) == [(b"a", b"x")]
    assert list(sse_events([b"event: a\ndata: x\n\nevent: b\ndata: y\n"])) == [(b"a", b"x")]
