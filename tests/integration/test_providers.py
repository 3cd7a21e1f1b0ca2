"""Both provider adapters over real HTTP against the simulator (no HTTP mocking).

Needs neither PostgreSQL nor Redis: only the simulator in a background thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import pytest

from batchgen.domain.formats.tokens import count_messages, count_text
from batchgen.errors import (
    CallCancelled,
    ContextLengthExceeded,
    MalformedResponse,
    PermanentProviderError,
    ProviderError,
    RateLimited,
    TransientProviderError,
)
from batchgen.providers import get_provider, lean_http
from batchgen.providers.anthropic import AnthropicProvider, to_messages_request
from batchgen.providers.base import ProviderRequest, ProviderResponse
from batchgen.providers.openai import OpenAIProvider, sdk_client
from batchgen.registry import ModelSpec, ProviderKind
from batchgen.simulator import SimulatorConfig, SimulatorThread, completion_text
from batchgen.simulator.state import key_id
from batchgen.simulator.text import anthropic_prompt_messages
from tests.helpers import settled_entry

SECRET = "zebra-quokka-secret"
SYSTEM = "You are terse."
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": f"Describe a lamp ({SECRET})."},
]
TPM, RPM = 1_000_000, 10_000
DEFAULTS: dict[str, Any] = {
    "tokens_per_min": TPM,
    "requests_per_min": RPM,
    "charge_mode": "reserve",
    "latency_base_ms": 0.0,
    "latency_per_token_ms": 0.0,
    "latency_jitter_ms": 0.0,
    "fault_rate": 0.0,
    "context_window": None,
    "hang_s": 5.0,
}
KINDS = ("openai", "anthropic")
_items = iter(range(1, 1_000_000))


ADMIN: dict[str, httpx.Client] = {}  # one keep-alive client for the /_sim endpoints


@pytest.fixture(scope="module")
def sim() -> Iterator[SimulatorThread]:
    with (
        SimulatorThread(SimulatorConfig(seed=5)) as server,
        httpx.Client(base_url=server.base_url) as admin,
    ):
        ADMIN[server.base_url] = admin
        yield server
        ADMIN.pop(server.base_url)


@pytest.fixture
def base(sim: SimulatorThread) -> str:
    """A freshly reset simulator with the default test settings."""
    ADMIN[sim.base_url].post("/_sim/reset").raise_for_status()
    configure(sim.base_url, **DEFAULTS)
    return sim.base_url


def configure(base: str, **changes: Any) -> None:
    ADMIN[base].post("/_sim/config", json=changes).raise_for_status()


def sim_log(base: str, item: int | None) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = ADMIN[base].get("/_sim/log", params={"item": str(item)}).json()
    return entries


def make_spec(
    kind: str, base: str, name: str | None = None, base_url: str | None = None
) -> ModelSpec:
    provider = ProviderKind(kind)
    return ModelSpec(
        name=name or ("sim-claude" if kind == "anthropic" else "sim-gpt"),
        provider=provider,
        base_url=base_url or (base if provider is ProviderKind.ANTHROPIC else base + "/v1"),
        api_key_env="BATCHGEN_TEST_PROVIDER_KEY",
        group="sim",
        budget_key="sim-test",
        context_window=16384,
        max_output_tokens=1024,
        tokens_per_min=TPM,
        requests_per_min=RPM,
        max_concurrency=8,
        input_usd_per_1m=1.0,
        output_usd_per_1m=2.0,
    )


def make_request(
    spec: ModelSpec,
    *,
    stream: bool = False,
    fault: str | None = None,
    timeout_s: float = 5.0,
    max_tokens: int = 400,
    cancel: threading.Event | None = None,
    lean_http: bool = True,
) -> ProviderRequest:
    return ProviderRequest(
        spec=spec,
        body={"model": spec.name, "messages": MESSAGES, "max_tokens": max_tokens},
        timeout_s=timeout_s,
        item_id=next(_items),
        cancel=cancel or threading.Event(),
        stream=stream,
        extra_headers={"x-sim-fault": fault} if fault else None,
        lean_http=lean_http,
    )


def expected_answer(kind: str, max_tokens: int = 400) -> tuple[str, int, int, str]:
    """(text, prompt tokens, completion tokens, finish) the simulator gives for MESSAGES."""
    prompt: list[Mapping[str, Any]] = list(MESSAGES)
    if kind == "anthropic":
        prompt = anthropic_prompt_messages(SYSTEM, MESSAGES[1:])
    text, tokens, finish = completion_text(prompt, max_tokens)
    return text, count_messages(prompt, "cl100k_base"), tokens, finish


def assert_no_text(exc: BaseException) -> None:
    message = str(exc)
    assert SECRET not in message and "Simulated" not in message
    assert "maximum context length" not in message and "too long" not in message


# -- success -------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_success(base: str, kind: str, stream: bool) -> None:
    spec = make_spec(kind, base)
    provider = get_provider(spec)
    assert isinstance(provider, AnthropicProvider if kind == "anthropic" else OpenAIProvider)
    request = make_request(spec, stream=stream)
    response = provider.complete(request)
    text, prompt, tokens, finish = expected_answer(kind)
    assert response.text == text and finish == "stop"
    assert (response.prompt_tokens, response.completion_tokens) == (prompt, tokens)
    assert response.finish_reason == "stop" and not response.usage_estimated
    body = response.body
    assert body["object"] == "chat.completion" and body["model"] == spec.name
    message = {k: v for k, v in body["choices"][0]["message"].items() if v is not None}
    assert message == {"role": "assistant", "content": text}  # the provider's nulls kept
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": tokens,
        "total_tokens": prompt + tokens,
    }
    entry = settled_entry(base, request.item_id)
    assert entry["completed"] and entry["status"] == 200 and entry["stream"] is stream
    assert entry["api"] == kind and response.request_id == entry["request_id"] == body["id"]
    limits = response.rate_limits
    assert limits.remaining_requests == RPM - 1
    assert limits.remaining_tokens == TPM - prompt - 400
    assert limits.reset_requests_s is not None and limits.reset_tokens_s is not None


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_truncated_answer(base: str, kind: str, stream: bool) -> None:
    spec = make_spec(kind, base)
    response = get_provider(spec).complete(make_request(spec, stream=stream, max_tokens=8))
    text, _, tokens, finish = expected_answer(kind, 8)
    assert finish == "length" and response.finish_reason == "length"
    assert (response.text, response.completion_tokens) == (text, tokens)


def test_anthropic_sampling_fields(base: str) -> None:
    """``temperature`` and ``top_p`` in a batch line for an Anthropic model: the SDK (2.x)
    has no keyword for them, so they go in the body through ``extra_body``."""
    spec = make_spec("anthropic", base)
    request = make_request(spec)
    line = dataclasses.replace(request, body={**request.body, "temperature": 0.2, "top_p": 0.9})
    assert get_provider(spec).complete(line).text == expected_answer("anthropic")[0]
    assert to_messages_request(line.body, 50)["extra_body"] == {"temperature": 0.2, "top_p": 0.9}


def test_azure_classic_route(base: str) -> None:
    """base_url with ``?api-version=``: the AzureOpenAI client, deployment = model name."""
    spec = make_spec("openai", base, "my-deployment", base + "/openai?api-version=2024-10-21")
    for stream in (False, True):
        request = make_request(spec, stream=stream)
        response = get_provider(spec).complete(request)
        assert response.text == expected_answer("openai")[0]
        entry = settled_entry(base, request.item_id)
        assert entry["model"] == "my-deployment" and entry["key"] != "anonymous"


def test_the_azure_provider_puts_its_deployment_in_the_path(base: str, monkeypatch) -> None:
    """provider ``azure``: the SDK's AzureOpenAI client on the resource's endpoint, the
    registry's ``azure_deployment`` in the path (whatever the model is called),
    ``api-version`` in the query, the key in the ``api-key`` header."""
    monkeypatch.setenv("BATCHGEN_TEST_PROVIDER_KEY", "azure-key-1")
    spec = make_spec("openai", base, "gpt-4o").model_copy(
        update={
            "provider": ProviderKind.AZURE,
            "base_url": base,
            "azure_deployment": "gpt-4o-prod",
            "api_version": "2024-10-21",
        }
    )
    for stream in (False, True):
        request = make_request(spec, stream=stream)
        response = get_provider(spec).complete(request)
        assert response.text == expected_answer("openai")[0]
        entry = settled_entry(base, request.item_id)
        assert (entry["model"], entry["key"]) == ("gpt-4o-prod", key_id("azure-key-1"))
    # Without the api-version the route does not exist (the simulator answers as Azure).
    bare = spec.model_copy(update={"api_version": ""})
    with pytest.raises(PermanentProviderError):
        get_provider(bare).complete(make_request(bare))


# -- errors --------------------------------------------------------------------

# (case id, x-sim-fault, simulator config changes, expected class, expected status)
ERROR_TABLE: list[tuple[str, str | None, dict[str, Any], type[ProviderError], int | None]] = [
    ("429", "status:429", {}, RateLimited, 429),
    ("408", "status:408", {}, TransientProviderError, 408),
    ("409", "status:409", {}, TransientProviderError, 409),
    ("500", "status:500", {}, TransientProviderError, 500),
    ("503", "status:503", {}, TransientProviderError, 503),
    ("529", "status:529", {}, TransientProviderError, 529),
    ("400", "status:400", {}, PermanentProviderError, 400),
    ("401", "status:401", {}, PermanentProviderError, 401),
    ("403", "status:403", {}, PermanentProviderError, 403),
    ("404", "status:404", {}, PermanentProviderError, 404),
    ("422", "status:422", {}, PermanentProviderError, 422),
    ("ctx-code", "status:400:context_length_exceeded", {}, ContextLengthExceeded, 400),
    ("ctx-window", None, {"context_window": 10}, ContextLengthExceeded, 400),
    ("timeout", "hang", {}, TransientProviderError, None),
    ("reset", "reset", {}, TransientProviderError, None),
    ("malformed", "malformed", {}, MalformedResponse, None),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("fault", "config", "expected", "status"),
    [row[1:] for row in ERROR_TABLE],
    ids=[row[0] for row in ERROR_TABLE],
)
def test_error_classification(
    base: str,
    kind: str,
    stream: bool,
    fault: str | None,
    config: dict[str, Any],
    expected: type[ProviderError],
    status: int | None,
) -> None:
    if config:
        configure(base, **config)
    if fault == "reset" and stream:  # cut after a few chunks, not before the answer
        configure(base, latency_per_token_ms=2.0)
    spec = make_spec(kind, base)
    request = make_request(spec, stream=stream, fault=fault, timeout_s=0.3)
    with pytest.raises(ProviderError) as err:
        get_provider(spec).complete(request)
    exc = err.value
    assert type(exc) is expected, f"{type(exc).__name__}: {exc}"
    assert exc.status == status or (status is None and exc.status in (None, 200))
    assert_no_text(exc)
    if expected is RateLimited:
        assert isinstance(exc, RateLimited) and exc.retry_after_s == 2.0
    if fault == "hang":
        assert exc.message.startswith("timeout")
    if fault == "reset":
        assert exc.message.startswith("connection error")
    if fault in ("hang", "reset", "malformed"):  # the request reached the model
        assert exc.billed
    if expected is not MalformedResponse and fault not in ("hang", "reset"):
        assert not exc.billed
    entry = settled_entry(base, request.item_id)
    assert entry["fault"] == fault
    assert entry["api"] == kind


@pytest.mark.parametrize("kind", KINDS)
def test_rate_limit_honours_retry_after_ms(base: str, kind: str) -> None:
    """A real limiter 429 sends retry-after-ms (~60000) and retry-after (whole s)."""
    configure(base, requests_per_min=1)
    spec = make_spec(kind, base)
    get_provider(spec).complete(make_request(spec))
    with pytest.raises(RateLimited) as err:
        get_provider(spec).complete(make_request(spec))
    assert err.value.retry_after_s is not None and 50.0 < err.value.retry_after_s <= 60.0
    assert err.value.status == 429 and not err.value.billed
    assert_no_text(err.value)


# -- cancel and deadline in a stream ----------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_stream_cancel_closes_the_connection(base: str, kind: str) -> None:
    """``cancel`` set from another thread mid-stream: CallCancelled at the next chunk,
    and the server sees the client leave long before the answer would have ended."""
    per_token_s = 0.04
    configure(base, latency_per_token_ms=per_token_s * 1000)
    _, prompt, tokens, _ = expected_answer(kind)
    full_s = per_token_s * tokens  # 32 tokens: ~1.3 s; chunks (~3 tokens) ~0.12 s apart
    assert full_s >= 1.0, "the answer must be long enough to cancel in the middle"
    spec = make_spec(kind, base)
    cancel = threading.Event()
    request = make_request(spec, stream=True, cancel=cancel)
    cancel_at = 0.3
    timer = threading.Timer(cancel_at, cancel.set)
    started = time.monotonic()
    timer.start()
    try:
        with pytest.raises(CallCancelled) as err:
            get_provider(spec).complete(request)
    finally:
        timer.cancel()
    raised_after = time.monotonic() - started
    assert cancel_at <= raised_after < full_s * 0.8
    exc = err.value
    assert exc.billed and exc.kind == "cancelled" and exc.status == 200
    assert exc.completion_tokens is not None and 0 < exc.completion_tokens < tokens
    if kind == "anthropic":  # message_start reported the input tokens
        assert exc.prompt_tokens == prompt
    assert_no_text(exc)
    entry = settled_entry(base, request.item_id)
    assert entry["completed"] is False and entry["stream"] and entry["status"] == 200
    assert entry["end_ts"] - entry["start_ts"] < full_s * 0.8
    assert exc.completion_tokens <= entry["completion_tokens"] < tokens


@pytest.mark.parametrize("kind", KINDS)
def test_stream_deadline(base: str, kind: str) -> None:
    """Chunks keep coming but the whole call passed ``timeout_s``: a billed timeout."""
    configure(base, latency_per_token_ms=30.0)  # chunks ~0.1 s apart, ~1 s in all
    spec = make_spec(kind, base)
    request = make_request(spec, stream=True, timeout_s=0.35)
    with pytest.raises(TransientProviderError) as err:
        get_provider(spec).complete(request)
    assert type(err.value) is TransientProviderError
    assert err.value.message == "timeout (stream deadline)" and err.value.billed
    entry = settled_entry(base, request.item_id)
    assert entry["completed"] is False and entry["completion_tokens"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_cancelled_before_the_call(base: str, kind: str) -> None:
    spec = make_spec(kind, base)
    cancel = threading.Event()
    cancel.set()
    request = make_request(spec, stream=True, cancel=cancel)
    with pytest.raises(CallCancelled) as err:
        get_provider(spec).complete(request)
    assert not err.value.billed and err.value.completion_tokens == 0
    assert sim_log(base, request.item_id) == []


def test_stream_and_plain_agree(base: str) -> None:
    for kind in KINDS:
        spec = make_spec(kind, base)
        plain = get_provider(spec).complete(make_request(spec))
        streamed = get_provider(spec).complete(make_request(spec, stream=True))
        assert _comparable(plain) == _comparable(streamed)
        assert count_text(streamed.text, "cl100k_base") == streamed.completion_tokens


def _outcome(spec: ModelSpec, fault: str | None, *, lean_http: bool = True) -> tuple[Any, ...]:
    """``lean_http=False``: through the SDK's httpx stack (``BATCHGEN_LEAN_HTTP=false``)."""
    request = make_request(spec, stream=True, fault=fault, timeout_s=0.3, lean_http=lean_http)
    try:
        response = get_provider(spec).complete(request)
    except ProviderError as exc:
        retry_after = exc.retry_after_s if isinstance(exc, RateLimited) else None
        message = exc.message.split(" (")[0].split(" request_id=")[0]
        return (type(exc), exc.status, exc.billed, message, retry_after)
    limits = response.rate_limits  # read from the headers (the remaining counts move on)
    assert limits is not None and limits.remaining_tokens is not None
    return _comparable(response) + (limits.reset_requests_s, limits.reset_tokens_s)


LEAN_CASES = [
    None,
    "status:429",
    "status:500",
    "status:400:context_length_exceeded",
    "hang",
    "reset",
]


def _sdk_client_of(spec: ModelSpec) -> Any:
    from batchgen.providers import anthropic as anthropic_adapter

    if spec.provider is ProviderKind.ANTHROPIC:
        return anthropic_adapter.sdk_client(spec.base_url, spec.api_key())
    return sdk_client(spec.base_url, spec.api_key())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fault", LEAN_CASES)
def test_lean_http_and_the_sdk_agree(base: str, fault: str | None, kind: str) -> None:
    """A streamed OpenAI or Anthropic call on the lean path (providers.lean_http) ends as it
    does through the SDK: the same answer and rate-limit headers, or the same error,
    status, billing."""
    if fault == "reset":
        configure(base, latency_per_token_ms=2.0)
    spec = make_spec(kind, base)
    assert lean_http.endpoint(_sdk_client_of(spec), True) is not None
    lean = _outcome(spec, fault)
    sdk = _outcome(spec, fault, lean_http=False)
    if fault is None:  # the resets count down between the two calls: to the second
        assert sdk[-2:] == pytest.approx(lean[-2:], abs=1.0)
        lean, sdk = lean[:-2], sdk[:-2]
    assert sdk == lean


@pytest.mark.parametrize("kind", KINDS)
def test_lean_http_refused_connection_is_not_billed(kind: str) -> None:
    """Nothing listens: the call surely never left, on either path."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}" + ("/v1" if kind == "openai" else "")
    spec = make_spec(kind, "", base_url=url)
    outcomes = []
    for lean in (True, False):
        with pytest.raises(TransientProviderError) as err:
            get_provider(spec).complete(make_request(spec, stream=True, lean_http=lean))
        outcomes.append((err.value.billed, err.value.message.split(" (")[0]))
    assert outcomes == [(False, "connection error")] * 2


def _comparable(response: ProviderResponse) -> tuple[Any, ...]:
    body = {k: v for k, v in response.body.items() if k not in ("id", "created")}
    return (response.text, response.prompt_tokens, response.completion_tokens, body)


def test_status_fault_wire_format(base: str) -> None:
    """``x-sim-fault: status:NNN[:code]`` answers in each API's error format."""
    body = {"model": "m", "messages": MESSAGES[1:], "max_tokens": 5}
    admin = ADMIN[base]
    resp = admin.post("/v1/chat/completions", json=body, headers={"x-sim-fault": "status:404"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    resp = admin.post("/v1/messages", json=body, headers={"x-sim-fault": "status:403"})
    assert resp.status_code == 403
    assert resp.json() == {
        "type": "error",
        "error": {"type": "permission_error", "message": "Simulated HTTP 403."},
    }
    resp = admin.post(
        "/v1/messages", json=body, headers={"x-sim-fault": "status:400:context_length_exceeded"}
    )
    assert resp.json()["error"]["message"].startswith("prompt is too long")
    resp = admin.post("/v1/messages", json=body, headers={"x-sim-fault": "status:429"})
    assert resp.headers["retry-after"] == "2" and "retry-after-ms" not in resp.headers
    assert (
        admin.post("/v1/messages", json=body, headers={"x-sim-fault": "status:200"}).status_code
        == 400
    )
    assert SimulatorConfig(fault_kinds=("5xx", "status:502")).fault_kinds[-1] == "status:502"
    with pytest.raises(ValueError):
        SimulatorConfig(fault_kinds=("status:302",))
    stats = admin.get("/_sim/stats").json()
    assert stats["faults"]["status:404"] == 1 and stats["rate_limited"] == 1


def test_azure_route_needs_api_version(base: str) -> None:
    spec = make_spec("openai", base, "my-deployment", base + "/openai")
    with pytest.raises(PermanentProviderError) as err:
        get_provider(spec).complete(make_request(spec))
    assert err.value.status == 404


@pytest.mark.parametrize("kind", KINDS)
def test_warm_builds_the_client_without_a_call(base: str, kind: str) -> None:
    """A worker warms each model's adapter when it starts: the SDK client (and, for an
    OpenAI-compatible model, the lean endpoint with its headers) exist afterwards, and
    nothing reached the provider."""
    spec = make_spec(kind, base, name=f"warm-{kind}")
    before = len(ADMIN[base].get("/_sim/log").json())
    get_provider(spec).warm(spec)
    assert len(ADMIN[base].get("/_sim/log").json()) == before
    lean = lean_http.endpoint(_sdk_client_of(spec), True)
    assert lean is not None and lean._headers is not None
    assert {k.lower() for k in lean._headers} & {"authorization", "x-api-key"}
    response = get_provider(spec).complete(make_request(spec, stream=True))
    assert response.completion_tokens > 0


def test_lean_http_verifies_tls_as_the_sdk_does() -> None:
    """An https endpoint's pool verifies certificates and host names with the context
    the SDK's transport builds (no connection is made here)."""
    import ssl

    client = sdk_client("https://provider.invalid/v1", "k")
    lean = lean_http.endpoint(client, True)
    assert lean is not None
    context = lean._ssl_context
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
    assert context.cert_store_stats()["x509_ca"] > 0  # the trust store is loaded


# Headers the SDK adds per attempt (its retry count and time-out) or the transport sets.
_PER_ATTEMPT_HEADERS = {
    "x-stainless-retry-count",
    "x-stainless-timeout",
    "x-stainless-read-timeout",
    "content-length",
    "accept-encoding",
    "connection",
    "host",
}

_ANTHROPIC_STREAM = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":'
    b'"assistant","model":"sim-claude","content":[],"stop_reason":null,'
    b'"usage":{"input_tokens":5,"output_tokens":1}}}\n\n'
    b'event: ping\ndata: {"type":"ping"}\n\n'
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
    b'"usage":{"output_tokens":2}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


@contextlib.contextmanager
def _provider_answering(
    content_type: str, payload: bytes, seen: list[tuple[str, dict[str, str], Any]]
) -> Iterator[int]:
    """A provider on a free port (yielded) that answers every POST with ``payload`` and
    keeps each request's path, headers (lower-cased) and JSON body in ``seen``."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Provider(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(200)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Provider)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("native", [False, True], ids=["chat-line", "messages-line"])
def test_lean_anthropic_stream_sends_the_sdks_request(native: bool) -> None:
    """A streamed Anthropic call on the lean path sends what the SDK sends (the same JSON body,
    the same headers but those the SDK sets per attempt) to the same path, and reads the
    same answer from the same events (a ping among them)."""
    from batchgen.domain.formats.message_batches import NATIVE_PARAMS

    seen: list[tuple[str, dict[str, str], Any]] = []
    with _provider_answering("text/event-stream", _ANTHROPIC_STREAM, seen) as port:
        spec = make_spec("anthropic", "", base_url=f"http://127.0.0.1:{port}")
        body: dict[str, Any] = {
            "model": spec.name,
            "messages": MESSAGES,
            "max_tokens": 40,
            "temperature": 0.5,
            "stop": ["END"],
        }
        if native:
            body[NATIVE_PARAMS] = {
                "model": "claude-x",
                "max_tokens": 40,
                "system": "Be brief.",
                "messages": [{"role": "user", "content": "Hi"}],
                "top_k": 3,
                "metadata": {"user_id": "u1"},
            }
        answers = []
        one = dataclasses.replace(make_request(spec, stream=True), body=body)
        for lean in (True, False):
            request = dataclasses.replace(one, lean_http=lean)
            answers.append(get_provider(spec).complete(request))
    (lean_path, lean_headers, lean_body), (sdk_path, sdk_headers, sdk_body) = seen
    assert lean_path == sdk_path == "/v1/messages"
    assert lean_body == sdk_body and lean_body["stream"] is True
    assert {k: v for k, v in lean_headers.items() if k not in _PER_ATTEMPT_HEADERS} == {
        k: v for k, v in sdk_headers.items() if k not in _PER_ATTEMPT_HEADERS
    }
    lean_answer, sdk_answer = answers
    assert lean_answer.text == sdk_answer.text == "Hi"
    assert _comparable(lean_answer) == _comparable(sdk_answer)


@pytest.mark.parametrize("fault", [None, "status:429", "status:500", "hang"])
@pytest.mark.parametrize("endpoint", ["/v1/responses", "/v1/embeddings"])
def test_lean_http_and_the_sdk_agree_on_whole_answers(
    base: str, endpoint: str, fault: str | None
) -> None:
    """A Responses API or embeddings call (a whole answer) on the lean path ends as it does
    through the SDK: the same answer, or the same error, status and billing."""
    spec = make_spec("openai", base)
    body: dict[str, Any] = {"model": spec.name, "input": "Describe a kettle."}
    if endpoint == "/v1/embeddings":
        body["input"] = ["a kettle", "a toaster"]
    one = dataclasses.replace(
        make_request(spec, fault=fault, timeout_s=0.3), endpoint=endpoint, body=body
    )
    outcomes = []
    for lean in (True, False):
        try:
            response = get_provider(spec).complete(dataclasses.replace(one, lean_http=lean))
        except ProviderError as exc:
            retry_after = exc.retry_after_s if isinstance(exc, RateLimited) else None
            message = exc.message.split(" (")[0].split(" request_id=")[0]
            outcomes.append((type(exc), exc.status, exc.billed, message, retry_after))
            continue
        answer = {k: v for k, v in response.body.items() if k not in ("id", "created_at")}
        outcomes.append((response.prompt_tokens, response.completion_tokens, answer))
    assert outcomes[0] == outcomes[1]
    if fault is None:
        assert outcomes[0][0] > 0


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "sdk"])
def test_a_whole_answer_that_is_not_an_object_is_malformed_and_billed(lean: bool) -> None:
    """A Responses API answer that is JSON but not an object: a billed malformed answer
    on either path, not an error no call should raise."""
    with _provider_answering("application/json", b"[1, 2]", []) as port:
        spec = make_spec("openai", "", base_url=f"http://127.0.0.1:{port}/v1")
        request = dataclasses.replace(
            make_request(spec, lean_http=lean),
            endpoint="/v1/responses",
            body={"model": spec.name, "input": "Hi"},
        )
        with pytest.raises(MalformedResponse) as err:
            get_provider(spec).complete(request)
    assert err.value.billed
