"""A streamed call's HTTP exchange on the worker's own HTTP/1.1 connections: the hot
path of every OpenAI-compatible and Anthropic item.

The SDK sends each request through its option models, header merging, URL joins and
httpx's client, transport and h11 layers. For one streamed chat call against a
provider that answers at once that is about 0.8 ms of CPU; urllib3's pooled connection
with the same body cost about 0.35 ms, most of it in the standard library's
``http.client`` (its header parser is the ``email`` package's) and urllib3's own
per-request objects. Here a request is written as bytes (the client's headers encoded
once) on a kept-alive socket and the answer is read by ``httptools`` (llhttp, the
parser uvicorn uses, in C): about 0.17 ms. The SDK still decides what is sent and
what an error is:

- the URL is the SDK client's ``base_url`` joined with the route, the headers its own
  (``default_headers``: user agent and platform headers; ``auth_headers``) plus the
  call's;
- an error answer (status >= 400) is read and handed to the SDK, which makes its typed
  error of it (``RateLimitError``, ``BadRequestError``... with body and headers), so
  :func:`batchgen.providers.openai.translate` maps it as before;
- a connection that cannot be had raises the SDK's ``APIConnectionError`` with
  :class:`NotConnected` as its cause (nothing was sent: never billed); no status line
  in time, its ``APITimeoutError``; a connection lost or an answer that is not HTTP
  before the status line, its ``APIConnectionError``; after it (the stream had
  started), :class:`TransportError` from the body's iterator;
- TLS verifies against the trust store the SDK's transport uses (httpcore's default
  context: ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``, else the system's).

Like urllib3 with ``retries=False``, nothing is ever sent twice: a kept-alive
connection the provider closed while idle is dropped before it is used (polled), and
one that fails under a request fails that request. A body is read to its end before
its connection goes back to the pool; a stream cut short (cancel, deadline, a bad
chunk) closes its connection, so the provider sees it end. ``timeout_s`` bounds the
connect and each read, as urllib3's did.

A Responses API or embeddings call (a whole answer, not a stream) takes the same POST
and reads its body to the end. The same holds for the ``anthropic`` SDK's client (its
errors are its own: the SDK's ``APIConnectionError``, ``APITimeoutError`` and typed
status errors). Any other client (Azure's, one behind an HTTP proxy from the
environment) keeps the SDK's own path; ``BATCHGEN_LEAN_HTTP=false`` turns this off
everywhere.
"""

from __future__ import annotations

import collections
import functools
import re
import select
import socket
import ssl
import sys
import threading
import urllib.request
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, urlsplit

import httpcore2
import httptools
import httpx2
import openai

from batchgen import json_codec
from batchgen.providers.base import NotConnected, TransportError

__all__ = ["LeanEndpoint", "NotConnected", "TransportError", "endpoint", "transport_errors"]


# Transport errors after the status line (a stream cut or stalled mid-body), for the
# adapters' ``except`` lists.
transport_errors: tuple[type[BaseException], ...] = (TransportError,)

# An SDK's connection and time-out errors, each made with the request it is about.
SdkErrors = tuple[Callable[..., Exception], Callable[..., Exception]]

_POOL_MAXSIZE = 64  # idle connections kept per endpoint; more in use are closed after
_RECV_BYTES = 65536
# What http.client refuses in a header: a name that is not a token, a value with a
# line break (an API key with a newline must not split the request).
_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_BAD_VALUE = re.compile(r"[\r\n\x00]")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class _Headers(dict[str, str]):
    """An answer's headers, looked up whatever the case of the name (keys are kept in
    lower case; a repeated header's values joined by ", ", as urllib3 and httpx do)."""

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return dict.get(self, name.lower(), default)


class _Answer:
    """httptools' callbacks for one answer: the headers, then the body's pieces."""

    __slots__ = ("body", "complete", "framed", "headers", "headers_done", "keep_alive", "parser")

    def __init__(self) -> None:
        # Set once made; dropped when the answer is closed (a reference cycle otherwise).
        self.parser: httptools.HttpResponseParser | None = None
        self.keep_alive = False
        self.headers = _Headers()
        self.headers_done = False
        self.body: collections.deque[bytes] = collections.deque()
        self.complete = False
        self.framed = False  # a length or chunked encoding ends the body (else: EOF)

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key in ("content-length", "transfer-encoding"):
            self.framed = True
        previous = dict.get(self.headers, key)
        dict.__setitem__(self.headers, key, text if previous is None else f"{previous}, {text}")

    def on_headers_complete(self) -> None:
        self.headers_done = True
        # Read now: the parser forgets the answer's version and headers once it ends.
        if self.parser is not None:
            self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


class LeanResponse:
    """A streamed answer's status line and headers, and its body as it arrives."""

    __slots__ = (
        "_answer",
        "_decoder",
        "_done",
        "_endpoint",
        "_parser",
        "_sock",
        "_url",
        "headers",
        "status_code",
    )

    def __init__(
        self,
        endpoint: LeanEndpoint,
        sock: socket.socket,
        parser: httptools.HttpResponseParser,
        answer: _Answer,
        url: str,
    ) -> None:
        self._endpoint = endpoint
        self._sock: socket.socket | None = sock
        self._parser = parser
        self._answer = answer
        self._url = url
        self._done = False
        self.status_code: int = parser.get_status_code()
        self.headers: Mapping[str, str] = answer.headers
        self._decoder = _decoder(answer.headers.get("content-encoding"))

    @property
    def request(self) -> httpx2.Request:
        """The request, as the SDK's errors about this answer carry it."""
        return httpx2.Request("POST", self._url)

    def iter_bytes(self) -> Iterator[bytes]:
        """The body's bytes as they come (a chunked body's chunks de-chunked), to its
        end; :class:`TransportError` if the connection fails first."""
        answer, decoder = self._answer, self._decoder
        body = answer.body
        while True:
            while body:
                piece = body.popleft()
                if decoder is not None:
                    piece = decoder.decompress(piece)
                if piece:
                    yield piece
            if answer.complete:
                break
            if not self._receive():  # the connection ended the body
                break
        if decoder is not None and (tail := decoder.flush()):
            yield tail
        self._done = True

    def _receive(self) -> bool:
        """One read fed to the parser; False at an end of the connection that ends an
        unframed body."""
        sock = self._sock
        if sock is None:
            raise TransportError("connection already closed")
        try:
            data = sock.recv(_RECV_BYTES)
        except TimeoutError as exc:
            raise TransportError("read timed out") from exc
        except OSError as exc:
            raise TransportError(f"connection lost ({type(exc).__name__})") from exc
        if not data:
            if self._answer.framed:
                raise TransportError("connection closed before the end of the body")
            self._answer.complete = True
            return False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise TransportError(f"not an HTTP answer ({type(exc).__name__})") from exc
        return True

    def close(self) -> None:
        """A body read to its end gives the connection back to the pool; a stream cut
        short (cancel, deadline, a bad chunk) closes it, so the provider sees it end."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        answer = self._answer
        answer.parser = None
        if self._done and answer.complete and answer.framed and answer.keep_alive:
            self._endpoint._give_back(sock)
            return
        sock.close()


def _decoder(encoding: str | None) -> Any:
    """A decompressor for a gzip or deflate body (sent though the request asked for
    ``identity``), None for a plain one."""
    if encoding is None or encoding.strip().lower() in ("", "identity"):
        return None
    if encoding.strip().lower() in ("gzip", "x-gzip", "deflate"):
        return zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib, by its header
    raise TransportError("answer in an unsupported content encoding")


class LeanEndpoint:
    """Streamed POSTs to one SDK client's ``base_url`` over kept-alive connections.
    ``errors``: the SDK's connection and time-out error classes."""

    def __init__(self, client: Any, errors: SdkErrors) -> None:
        self._client = client
        self._connection_error, self._timeout_error = errors
        self._base = str(client.base_url).rstrip("/")
        parts = urlsplit(self._base)
        self._host = parts.hostname or ""
        self._port = parts.port or _DEFAULT_PORTS[parts.scheme]
        # The request target as http.client would write it (urllib3 quoted it so).
        self._path = quote(parts.path, safe="/%:@!$&'()*+,;=-._~")
        self._ssl_context: ssl.SSLContext | None = None
        if parts.scheme == "https":  # the trust store the SDK's httpx uses
            self._ssl_context = httpcore2.default_ssl_context()
        host = f"[{self._host}]" if ":" in self._host else self._host
        self._host_header = (
            host if parts.port in (None, _DEFAULT_PORTS[parts.scheme]) else (f"{host}:{self._port}")
        )
        self._idle: collections.deque[socket.socket] = collections.deque()
        self._headers: dict[str, str] | None = None
        self._head: bytes | None = None  # the client's header lines, once encoded
        self._names: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    def _base_headers(self) -> dict[str, str]:
        if self._headers is None:
            with self._lock:
                if self._headers is None:
                    merged = {**self._client.default_headers, **self._client.auth_headers}
                    headers = {k: v for k, v in merged.items() if isinstance(v, str)}
                    try:
                        self._head = _header_lines({"Host": self._host_header, **headers}, {})
                    except ValueError:  # each request says so (post_stream), none is sent
                        self._head = None
                    self._names = frozenset(k.lower() for k in headers)
                    self._headers = headers
        return self._headers

    def warm(self) -> None:
        """Work out the headers now (the SDK's platform headers take a while once)."""
        self._base_headers()

    def post_stream(
        self, route: str, body: dict[str, Any], headers: Mapping[str, str], timeout_s: float
    ) -> LeanResponse:
        """POST ``body`` as JSON and return once the status line and headers are in.
        An error status raises the SDK's typed error (its body read first)."""
        url = self._base + route
        data = json_codec.dumps(body)
        base = self._base_headers()
        try:
            if self._head is None or any(k.lower() in self._names for k in headers):
                # the call's own headers replace the client's of the same name
                head = _header_lines({"Host": self._host_header, **base}, headers)
            else:
                head = self._head + _header_lines({}, headers)
            path = (self._path + route).encode("ascii")
        except ValueError as exc:
            # A header this request cannot carry (an API key with a newline), before
            # anything is sent: the message names the kind of failure only.
            unsent = httpx2.LocalProtocolError(f"request not sendable ({type(exc).__name__})")
            raise self._connection_error(request=httpx2.Request("POST", url)) from unsent
        message = b"".join(
            (
                b"POST ",
                path,
                b" HTTP/1.1\r\n",
                head,
                b"Accept-Encoding: identity\r\n",
                b"Content-Length: ",
                str(len(data)).encode(),
                b"\r\n\r\n",
                data,
            )
        )
        sock = self._connection(url, timeout_s)
        answer = _Answer()
        parser = answer.parser = httptools.HttpResponseParser(answer)
        try:
            sock.sendall(message)
            while not answer.headers_done:
                received = sock.recv(_RECV_BYTES)
                if not received:
                    raise TransportError("connection closed before the status line")
                parser.feed_data(received)
        except TimeoutError as exc:
            sock.close()
            raise self._timeout_error(request=httpx2.Request("POST", url)) from exc
        except (OSError, TransportError, httptools.HttpParserError) as exc:
            sock.close()
            cause = (
                exc
                if isinstance(exc, TransportError)
                else TransportError(f"connection lost ({type(exc).__name__})")
            )
            raise self._connection_error(request=httpx2.Request("POST", url)) from cause
        try:
            response = LeanResponse(self, sock, parser, answer, url)
        except TransportError as exc:
            sock.close()
            raise self._connection_error(request=httpx2.Request("POST", url)) from exc
        if response.status_code >= 400:
            try:
                content = b"".join(response.iter_bytes())
            except TransportError as exc:
                raise self._connection_error(request=response.request) from exc
            finally:
                response.close()
            answer_read = httpx2.Response(
                response.status_code,
                # The body is decoded already: not again by the SDK's response.
                headers=[(k, v) for k, v in answer.headers.items() if k != "content-encoding"],
                content=content,
                request=response.request,
            )
            raise self._client._make_status_error_from_response(answer_read)
        return response

    def _connection(self, url: str, timeout_s: float) -> socket.socket:
        """An idle kept-alive connection the provider has not closed, or a new one."""
        idle = self._idle
        while idle:
            try:
                sock = idle.pop()
            except IndexError:
                break
            if _still_open(sock):
                sock.settimeout(timeout_s)
                return sock
            sock.close()
        try:
            sock = socket.create_connection((self._host, self._port), timeout_s)
        except OSError as exc:  # refused, unreachable, unknown host, connect time-out
            cause = NotConnected(f"no connection ({type(exc).__name__})")
            cause.__cause__ = exc
            raise self._connection_error(request=httpx2.Request("POST", url)) from cause
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._ssl_context is not None:
            try:
                sock = self._ssl_context.wrap_socket(sock, server_hostname=self._host)
            except OSError as exc:  # the handshake (a certificate refused): nothing sent
                sock.close()
                cause = NotConnected(f"no TLS session ({type(exc).__name__})")
                cause.__cause__ = exc
                raise self._connection_error(request=httpx2.Request("POST", url)) from cause
        return sock

    def _give_back(self, sock: socket.socket) -> None:
        if len(self._idle) < _POOL_MAXSIZE:
            self._idle.append(sock)
        else:
            sock.close()


def _still_open(sock: socket.socket) -> bool:
    """An idle connection can take a request: nothing to read on it (a readable idle
    socket is one the provider closed, or one with stray bytes: either is dropped)."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError):  # closed meanwhile
        return False


def _header_lines(first: Mapping[str, str], then: Mapping[str, str]) -> bytes:
    """``Name: value`` lines for ``first`` updated by ``then`` (latin-1, as http.client
    writes them); ValueError for a name or value a request cannot carry."""
    merged = first
    if then:  # a name of ``then`` replaces ``first``'s, whatever its case
        names = {name.lower() for name in then}
        merged = {k: v for k, v in first.items() if k.lower() not in names} | dict(then)
    lines = []
    for name, value in merged.items():
        if not _HEADER_NAME.match(name) or _BAD_VALUE.search(value):
            raise ValueError("header not allowed in a request")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("latin-1")


def _behind_proxy(url: str) -> bool:
    """True when the environment sends ``url`` through a proxy (the SDK's httpx honours
    ``HTTPS_PROXY`` and friends; this path does not)."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(parts.hostname or "")


def _sdk_errors(client: Any) -> SdkErrors | None:
    """The connection and time-out errors of ``client``'s SDK, when it is a plain client
    of one this path speaks for (``openai.OpenAI``, ``anthropic.Anthropic``)."""
    if type(client) is openai.OpenAI:
        return openai.APIConnectionError, openai.APITimeoutError
    anthropic = sys.modules.get("anthropic")  # imported by its adapter, not here
    if anthropic is not None and type(client) is anthropic.Anthropic:
        return anthropic.APIConnectionError, anthropic.APITimeoutError
    return None


@functools.cache
def _endpoint_for(client: Any) -> LeanEndpoint | None:
    base = str(client.base_url)
    parts = urlsplit(base)
    errors = _sdk_errors(client)
    if errors is None or parts.query or _behind_proxy(base):
        return None
    if parts.scheme not in ("http", "https"):  # the SDK's own stack refuses it as such
        return None
    try:
        parts.port  # noqa: B018  (ValueError for a port that is not one)
    except ValueError:
        return None  # as the SDK's own stack refuses it: unsendable
    if not parts.hostname:
        return None
    return LeanEndpoint(client, errors)


def endpoint(client: Any, enabled: bool) -> LeanEndpoint | None:
    """The lean path for ``client`` (one per client and process), or None: turned off,
    not a plain OpenAI or Anthropic client (Azure's routes differ), a base URL with a
    query, a scheme other than http(s), no host or a bad port (the SDK's stack says
    which), or behind a proxy."""
    return _endpoint_for(client) if enabled else None
