"""The provider interface: one call, a deadline, a cancellation signal.

Also what both adapters share: :func:`chat_params`, the SDK arguments of a
call around each adapter's translation of the batch line's body; the mapping
of HTTP statuses and transport failures to :mod:`batchgen.errors`; and
:class:`StreamWatch`, which ends a stream between chunks when the call is
cancelled or its time is up.

Error messages built here carry the HTTP status, exception class and the
provider's error code or type only, never prompt or completion text (nor the
provider's free-text message, which may quote the request).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpcore2
import httpx2

from batchgen.domain.formats.endpoints import CHAT_COMPLETIONS
from batchgen.domain.formats.tokens import count_text
from batchgen.domain.lifecycle.retry import parse_retry_after_s
from batchgen.domain.scheduling.rate_limits import RateLimitState
from batchgen.errors import (
    CallCancelled,
    ContextLengthExceeded,
    FlexUnavailable,
    PermanentProviderError,
    ProviderError,
    RateLimited,
    TransientProviderError,
    Unsendable,
)
from batchgen.providers.headers import rate_limits_of
from batchgen.registry import ModelSpec

# Sent with every call so the provider (and the simulator's log) can be matched to an item.
ITEM_HEADER = "x-batchgen-item"
TRANSIENT_STATUSES = frozenset({408, 409})
# Wording of context-window 400s by OpenAI, Azure, vLLM, Ollama and Anthropic.
_CONTEXT_HINTS = re.compile(
    r"context[ _]length|context window|maximum context|prompt is too long", re.IGNORECASE
)
# OpenAI's flex tier refuses a busy call with 429 "Resource Unavailable" (its code, or
# only its wording): not a rate limit of the account.
FLEX_UNAVAILABLE_CODE = "resource_unavailable"
_FLEX_UNAVAILABLE = re.compile(r"resource[ _]unavailable", re.IGNORECASE)
_SAFE_CODE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class TransportError(Exception):
    """The lean path's exchange (:mod:`batchgen.providers.lean_http`) failed on the
    wire: the connection was cut, stalled past its read time-out, or carried something
    that is not an HTTP answer. The message names the kind of failure only."""


class NotConnected(TransportError):
    """No connection could be made on the lean path (refused, unreachable, connect
    time-out, TLS handshake): nothing of the request was sent."""


# Failures before any byte of the request was written, at the httpx layer and at
# the httpcore layer under it (which the SDKs' chains end in), and the lean path's
# (providers.lean_http: no connection, or no TLS session).
_NEVER_SENT: tuple[type[BaseException], ...] = (
    httpx2.ConnectError,
    httpx2.ConnectTimeout,
    httpx2.PoolTimeout,
    httpcore2.ConnectError,
    httpcore2.ConnectTimeout,
    httpcore2.PoolTimeout,
    NotConnected,
)

# Failures of building or writing the request itself, before any byte left: a URL the
# client cannot use (scheme, host, port), a header it cannot carry (an API key with a
# newline). The deployment's configuration, not the network: no retry mends them.
_UNSENDABLE: tuple[type[BaseException], ...] = (
    httpx2.UnsupportedProtocol,
    httpx2.InvalidURL,
    httpx2.LocalProtocolError,
    httpcore2.UnsupportedProtocol,
    httpcore2.LocalProtocolError,
)
UNSENDABLE_HINT = "check the deployment's base_url and API key"


@dataclass(frozen=True)
class ProviderRequest:
    """One request. ``body`` is the OpenAI-format request body from the batch line, of
    ``endpoint`` (chat completions; or the Responses API, embeddings).

    ``timeout_s`` bounds the whole call (for a stream: until the last chunk).
    ``cancel`` is checked before the call and between stream chunks.
    ``extra_headers`` are sent as they are (e.g. ``x-sim-fault`` in tests).
    ``cache_prefix``: the prompt's prefix is shared with other requests (Anthropic:
    :func:`batchgen.domain.formats.prompt_cache.with_cache_breakpoint`).
    ``on_chunk``, for a stream, is handed each chunk as soon as it is read, in the
    form of the answer of record: OpenAI ``chat.completion.chunk`` objects, or the
    Anthropic events of a Messages request's own ``Message``.
    """

    spec: ModelSpec
    body: dict[str, Any]
    timeout_s: float
    item_id: int | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    stream: bool = False
    extra_headers: Mapping[str, str] | None = None
    endpoint: str = CHAT_COMPLETIONS
    on_chunk: Callable[[dict[str, Any]], None] | None = None
    # The prompt's prefix is shared with other items (batchgen.domain.formats.prompt_cache): an
    # Anthropic call marks it for the provider's cache unless the request marks its own.
    cache_prefix: bool = False
    # A streamed OpenAI-compatible or Anthropic call goes on the lean path where it
    # can (batchgen.providers.lean_http: kept-alive sockets, httptools); False:
    # through the SDK's httpx stack (BATCHGEN_LEAN_HTTP, settings.providers.lean_http,
    # set by the worker).
    lean_http: bool = True

    def headers(self) -> dict[str, str]:
        """HTTP headers of the call: the item id plus ``extra_headers``."""
        out = {ITEM_HEADER: str(self.item_id)} if self.item_id is not None else {}
        out.update(self.extra_headers or {})
        return out


def chat_params(request: ProviderRequest, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The SDK keyword arguments of one chat call, for either adapter.

    ``fields`` is the adapter's own translation of the batch line's body: its
    messages and whichever other fields it forwards (it leaves out the body's
    ``model``, ``stream`` and ``stream_options``). Shared here: the model is
    the registry's name, whatever the batch line says, and the call carries
    :meth:`ProviderRequest.headers` and ``timeout_s``. A streamed call
    (``request.stream``) adds ``stream=True`` at the call site.
    """
    return {
        **fields,
        "model": request.spec.name,
        "extra_headers": request.headers(),
        "timeout": request.timeout_s,
    }


@dataclass(frozen=True)
class ProviderResponse:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    request_id: str | None
    # The answer as the batch output file carries it: an OpenAI chat.completion (or an
    # Anthropic Message), a Responses API Response, an embeddings list.
    body: dict[str, Any]
    rate_limits: RateLimitState = RateLimitState()
    # True when the provider reported no usage and the counts are local tiktoken counts.
    usage_estimated: bool = False


class Provider(Protocol):
    def complete(self, request: ProviderRequest) -> ProviderResponse:
        """Make the call; raise a :class:`batchgen.errors.ProviderError` subclass on failure."""
        ...

    def warm(self, spec: ModelSpec) -> None:
        """Build what a first call to ``spec`` would build (its SDK client, connection
        pool, headers), without touching the network: a call admitted by the budget
        reaches the provider promptly, also the first one of a process."""
        ...


def safe_code(value: object) -> str | None:
    """A provider error code or type if it looks like an identifier, else None."""
    return value if isinstance(value, str) and _SAFE_CODE.match(value) else None


def classify_status(
    status: int,
    message: str,
    headers: Mapping[str, str] | None,
    code: str | None,
    *,
    provider_message: str | None = None,
    billed: bool = False,
) -> ProviderError:
    """Map an HTTP error answer to the project's error tree.

    ``message`` becomes the error's message; ``provider_message`` (the
    provider's own text) is only inspected for context-length wording.
    """
    if status == 429 and (
        code == FLEX_UNAVAILABLE_CODE or _FLEX_UNAVAILABLE.search(provider_message or "")
    ):
        return FlexUnavailable(message, retry_after_s=parse_retry_after_s(dict(headers or {})))
    if status == 429:
        return RateLimited(
            message,
            retry_after_s=parse_retry_after_s(dict(headers or {})),
            rate_limits=rate_limits_of(headers),  # a 429's headers calibrate the budget too
        )
    if status in TRANSIENT_STATUSES or status >= 500:
        return TransientProviderError(message, status=status, billed=billed)
    if status == 400 and (
        code == "context_length_exceeded" or _CONTEXT_HINTS.search(provider_message or "")
    ):
        return ContextLengthExceeded(message, status=status)
    return PermanentProviderError(message, status=status)


def status_message(
    status: int, exc: BaseException, code: str | None, request_id: str | None
) -> str:
    """``"HTTP 429 RateLimitError code=rate_limit_exceeded request_id=..."`` (no text)."""
    parts = [f"HTTP {status}", type(exc).__name__]
    if code:
        parts.append(f"code={code}")
    if safe_code(request_id):
        parts.append(f"request_id={request_id}")
    return " ".join(parts)


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it was raised from or while handling (each once).

    SDKs wrap transport errors in layers (``openai.APIConnectionError`` from
    ``httpx2.ConnectError`` from ``httpcore2.ConnectError`` while handling
    ``ConnectionRefusedError``), linked by ``__cause__`` or only by ``__context__``.
    """
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending.extend(e for e in (current.__context__, current.__cause__) if e is not None)


def never_sent(exc: BaseException) -> bool:
    """True when the request surely never reached the provider: the connection
    (or a connection from the pool) could not be had, so no byte was written."""
    return any(isinstance(e, _NEVER_SENT) for e in exception_chain(exc))


def unsendable(exc: BaseException) -> Unsendable | None:
    """The failure as :class:`Unsendable` when the request could not be built or
    written (:data:`_UNSENDABLE` anywhere in its chain), else None. The message names
    the exception's class only: its text may quote the URL or the key."""
    local = next((e for e in exception_chain(exc) if isinstance(e, _UNSENDABLE)), None)
    if local is None:
        return None
    return Unsendable(f"request not sendable ({type(local).__name__}): {UNSENDABLE_HINT}")


def unusable_client(exc: BaseException) -> Unsendable:
    """A client that could not be built (it sends nothing): the deployment's
    configuration, named by the exception's class only."""
    return Unsendable(f"client not buildable ({type(exc).__name__}): {UNSENDABLE_HINT}")


class UnusableProvider:
    """The adapter of a deployment whose client could not be built: every call fails
    with :class:`Unsendable` and sends nothing, so its item fails over or fails rather
    than raising before it is claimed, again and again."""

    def __init__(self, error: Unsendable) -> None:
        self.message = error.message

    def warm(self, spec: ModelSpec) -> None:
        """Nothing to build."""

    def complete(self, request: ProviderRequest) -> ProviderResponse:
        cancelled_before_call(request)
        raise Unsendable(self.message)


def transport_error(exc: BaseException, *, in_stream: bool = False) -> TransientProviderError:
    """A timeout, reset or protocol failure (SDK-wrapped or raw ``httpx2``) as a transient error.

    ``in_stream`` says the answer had started (status and headers received):
    then it may be billed, whatever failed. Before that, ``billed`` is False
    only when the request surely never left (connect failures, pool time-outs).
    """
    unsent = not in_stream and never_sent(exc)
    root = _innermost(exc)
    if isinstance(root, TimeoutError | httpx2.TimeoutException) or "Timeout" in type(exc).__name__:
        return TransientProviderError(f"timeout ({type(root).__name__})", billed=not unsent)
    return TransientProviderError(f"connection error ({type(root).__name__})", billed=not unsent)


def _innermost(exc: BaseException) -> BaseException:
    """The exception at the bottom of the ``__cause__`` chain (for the message)."""
    while exc.__cause__ is not None and exc.__cause__ is not exc:
        exc = exc.__cause__
    return exc


def sse_data(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The ``data:`` field of each server-sent event line, from the body's byte chunks
    as they arrive (lines end in LF, CRLF or CR; other fields are skipped).

    A byte-level reader: the SDK's text line reader decodes and re-splits every chunk
    and costs more than the rest of a call's handling.
    """
    rest = b""
    for chunk in chunks:
        if not chunk:
            continue
        if b"\r" in chunk:  # a CRLF split across chunks leaves an empty line: skipped
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if rest.startswith(b"data:"):
        yield rest[5:].strip()


def _field_value(line: bytes, name_len: int) -> bytes:
    value = line[name_len:]
    return value[1:] if value.startswith(b" ") else value


def sse_events(chunks: Iterable[bytes]) -> Iterator[tuple[bytes | None, bytes]]:
    """Each server-sent event of the body's byte chunks, as it completes: its name (the
    ``event:`` field; None without one) and its data (the ``data:`` lines joined by
    LF). Lines end in LF, CRLF or CR (a CRLF split across two chunks included);
    comments and other fields are skipped; an event the body ends before its blank
    line is dropped. A byte-level reader, as :func:`sse_data`."""
    rest = b""
    name: bytes | None = None
    data: list[bytes] = []
    after_cr = False
    for chunk in chunks:
        if not chunk:
            continue
        if after_cr and chunk.startswith(b"\n"):  # the LF of a CRLF the last chunk split
            chunk = chunk[1:]
        after_cr = chunk.endswith(b"\r")
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            if not line:  # the blank line that ends an event
                if name is not None or data:
                    yield name, b"\n".join(data)
                name, data = None, []
            elif line.startswith(b"data:"):
                data.append(_field_value(line, 5))
            elif line.startswith(b"event:"):
                name = _field_value(line, 6)
    # An event the body ends before its blank line is dropped, as the SDKs' readers and
    # the SSE specification drop it: a stream cut there ends unfinished.


class StreamWatch:
    """Collects a stream's text and stops it, between chunks, on cancel or deadline.

    Call :meth:`check` before reading each next chunk. The caller closes the
    response in a ``finally`` (so the server sees the client leave) whatever
    :meth:`check` raised.
    """

    def __init__(self, request: ProviderRequest, started: float | None = None) -> None:
        self.request = request
        self.deadline = (started if started is not None else time.monotonic()) + request.timeout_s
        self.pieces: list[str] = []
        self.prompt_tokens: int | None = None

    def add(self, text: str | None) -> None:
        if text:
            self.pieces.append(text)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def received_tokens(self) -> int:
        """Tokens of the text received so far (local count with the model's encoding)."""
        return count_text(self.text, self.request.spec.encoding) if self.pieces else 0

    def check(self) -> None:
        """Raise :class:`CallCancelled` or a timeout when the stream must stop now."""
        if self.request.cancel.is_set():
            received = self.received_tokens()
            raise CallCancelled(
                f"cancelled mid-stream after {received} completion tokens",
                status=200,
                billed=True,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=received,
            )
        if time.monotonic() > self.deadline:
            raise TransientProviderError("timeout (stream deadline)", status=200, billed=True)


def cancelled_before_call(request: ProviderRequest) -> None:
    """Raise :class:`CallCancelled` (not billed) if the call was cancelled before it started."""
    if request.cancel.is_set():
        raise CallCancelled("cancelled before the call", billed=False, completion_tokens=0)
