"""Transport failures as the SDKs really raise them: was the request sent?"""

from __future__ import annotations

import socket

import anthropic
import httpx2
import openai
import pytest

from batchgen.providers import anthropic as anthropic_adapter
from batchgen.providers import openai as openai_adapter
from batchgen.providers.base import never_sent, transport_error


def _closed_port() -> int:
    """A local port nothing listens on: a connect to it is refused by the kernel."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _refused(kind: str, stream: bool) -> BaseException:
    port = _closed_port()
    messages = [{"role": "user", "content": "hi"}]
    try:
        if kind == "openai":
            oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
            oa.chat.completions.create(model="m", messages=messages, stream=stream)  # type: ignore[call-overload]
        else:
            an = anthropic.Anthropic(
                base_url=f"http://127.0.0.1:{port}", api_key="k", max_retries=0
            )
            an.messages.create(model="m", max_tokens=5, messages=messages, stream=stream)  # type: ignore[call-overload]
    except Exception as exc:  # the SDK's own exception is what we test
        return exc
    raise AssertionError("the connect was not refused")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_sdk_connect_refused_is_never_sent(kind, stream):
    exc = _refused(kind, stream)
    assert never_sent(exc)
    adapter = openai_adapter if kind == "openai" else anthropic_adapter
    error = adapter.translate(exc)
    assert (error.kind, error.billed, error.status) == ("transient", False, None)


def test_failures_after_the_request_may_be_billed():
    for exc in (
        httpx2.ReadTimeout("read"),
        httpx2.RemoteProtocolError("peer closed"),
        httpx2.WriteError("broken pipe"),
    ):
        assert not never_sent(exc)
        assert transport_error(exc).billed


def test_an_answer_that_started_is_billed_even_on_a_connect_error_in_its_chain():
    assert transport_error(httpx2.ConnectError("refused"), in_stream=True).billed


def test_chain_walks_context_as_well_as_cause():
    try:
        try:
            raise httpx2.ConnectTimeout("connect")
        except httpx2.ConnectTimeout:
            raise RuntimeError("wrapped without from")  # noqa: B904 - the point of the test
    except RuntimeError as exc:
        assert never_sent(exc)
        assert not transport_error(exc).billed
