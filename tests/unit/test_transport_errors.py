"""Transport failures as the SDKs really raise them: was the request sent?"""

from __future__ import annotations

import socket

import anthropic
import httpx2
import openai
import pytest

from batchgen.errors import Unsendable
from batchgen.providers import anthropic as anthropic_adapter
from batchgen.providers import openai as openai_adapter
from batchgen.providers import warmed_provider
from batchgen.providers.base import ProviderRequest, UnusableProvider, never_sent, transport_error
from batchgen.registry import parse_registry


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


MODEL = """
[models."m"]
provider = "{provider}"
base_url = "{base_url}"
api_key_env = "BATCHGEN_TEST_UNSENDABLE_KEY"
group = "g"
budget_key = "m"
context_window = 1000
max_output_tokens = 10
tokens_per_min = 1000
requests_per_min = 10
max_concurrency = 2
input_usd_per_1m = 1
output_usd_per_1m = 1
"""


def _call(provider: str, base_url: str, stream: bool) -> BaseException:
    spec = parse_registry(MODEL.format(provider=provider, base_url=base_url))["m"]
    adapter = warmed_provider(spec)
    body = {"messages": [{"role": "user", "content": "secret prompt"}], "max_tokens": 5}
    try:
        adapter.complete(ProviderRequest(spec=spec, body=body, timeout_s=5, stream=stream))
    except Exception as exc:  # what the adapter raises is what we test
        return exc
    raise AssertionError("the call was sent")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_an_api_key_no_header_can_carry_fails_unsendable_naming_no_key(monkeypatch, kind, stream):
    """A key with a newline (a secret file's last line) is refused by the HTTP stack
    before any byte leaves: permanent, never billed, the key nowhere in the message."""
    monkeypatch.setenv("BATCHGEN_TEST_UNSENDABLE_KEY", "sk-secret-key\n")
    with socket.socket() as listening:  # the kernel completes connects; nothing answers
        listening.bind(("127.0.0.1", 0))
        listening.listen(8)
        port = listening.getsockname()[1]
        exc = _call(kind, f"http://127.0.0.1:{port}/v1", stream)
    assert isinstance(exc, Unsendable), repr(exc)
    assert (exc.kind, exc.billed, exc.status) == ("unsendable", False, None)
    assert "sk-secret" not in exc.message and "secret prompt" not in exc.message


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_base_url_no_client_can_use_fails_unsendable(kind, stream):
    """A URL past the registry's check (a spec built in code) that the client refuses:
    an unsupported scheme, an unparseable host (the client cannot even be built)."""
    for url in ("ftp://127.0.0.1/v1", "http://[::1/v1"):
        spec = parse_registry(MODEL.format(provider=kind, base_url="http://h/v1"))["m"]
        spec = spec.model_copy(update={"base_url": url})
        adapter = warmed_provider(spec)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        request = ProviderRequest(spec=spec, body=body, timeout_s=5, stream=stream)
        with pytest.raises(Unsendable):
            adapter.complete(request)
    assert isinstance(warmed_provider(spec), UnusableProvider)
