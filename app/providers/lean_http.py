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
import contextlib
import functools
import os
import re
import select
import socket
import ssl
import sys
import threading
import urllib.request
import weakref
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
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\r\n\x00]")
# Written by this module alone: the request's framing and target are its own, so a
# client's or a call's header of one of these names is left out.
_OWN_HEADERS = frozenset(
    ("host", "content-length", "transfer-encoding", "connection", "accept-encoding")
)
_DEFAULT_PORTS = {"http": 80, "https": 443}
_PARSER_ERRORS = (httptools.HttpParserError, httptools.HttpParserUpgrade)


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
    """httptools' callbacks for one answer: the headers, then the body's pieces.

    An interim answer (1xx: ``100 Continue``, ``103 Early Hints``) is skipped: the
    final one follows on the same connection. Anything after the final answer (a
    second one, stray bytes) is not read into it, and keeps the connection from being
    used again."""

    __slots__ = (
        "body",
        "complete",
        "framed",
        "headers",
        "headers_done",
        "interim",
        "keep_alive",
        "parser",
        "trailing",
    )

    def __init__(self) -> None:
        # Set once made; dropped when the answer is closed (a reference cycle otherwise).
        self.parser: httptools.HttpResponseParser | None = None
        self.keep_alive = False
        self.headers = _Headers()
        self.headers_done = False
        self.interim = False  # the message being read is a 1xx
        self.body: collections.deque[bytes] = collections.deque()
        self.complete = False
        self.trailing = False  # bytes came after the final answer
        self.framed = False  # a length or chunked encoding ends the body (else: EOF)

    def on_message_begin(self) -> None:
        if self.complete:
            self.trailing = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.complete or self.headers_done:  # a trailer, or another message
            return
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key in ("content-length", "transfer-encoding"):
            self.framed = True
        previous = dict.get(self.headers, key)
        dict.__setitem__(self.headers, key, text if previous is None else f"{previous}, {text}")

    def on_headers_complete(self) -> None:
        parser = self.parser
        if self.complete or parser is None:
            return
        if 100 <= parser.get_status_code() < 200:
            self.interim = True  # its headers are not the answer's
            self.headers.clear()
            self.framed = False
            return
        self.headers_done = True
        # Read now: the parser forgets the answer's version and headers once it ends.
        self.keep_alive = parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
        elif self.headers_done:
            self.complete = True


class LeanResponse:
    """A streamed answer's status line and headers, and its body as it arrives."""

    __slots__ = (
        "_answer",
        "_decoder",
        "_done",
        "_endpoint",
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
        self._answer = answer  # it holds the parser until close()
        self._url = url
        self._done = False
        self.status_code: int = parser.get_status_code()
        self.headers: Mapping[str, str] = answer.headers
        self._decoder: Any = None
        encoding = answer.headers.get("content-encoding")
        if self.status_code < 400:
            self._decoder = _decoder(encoding)
        elif encoding is not None:  # an error's body: raw if it cannot be decoded
            with contextlib.suppress(TransportError):
                self._decoder = _decoder(encoding)

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
                    piece = _decompress(decoder, piece)
                if piece:
                    yield piece
            if answer.complete:
                break
            if not self._receive():  # the connection ended the body
                break
        if decoder is not None:
            try:
                tail = decoder.flush()
            except zlib.error as exc:
                raise TransportError("answer not decodable") from exc
            if not decoder.eof:
                raise TransportError("compressed answer cut short")
            if tail:
                yield tail
        self._done = True

    def _receive(self) -> bool:
        """One read fed to the parser; False at an end of the connection that ends an
        unframed body."""
        sock, parser = self._sock, self._answer.parser
        if sock is None or parser is None:
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
            parser.feed_data(data)
        except _PARSER_ERRORS as exc:
            raise TransportError(f"not an HTTP answer ({type(exc).__name__})") from exc
        return True

    def close(self) -> None:
        """A body read to its end gives the connection back to the pool; a stream cut
        short (cancel, deadline, a bad chunk) closes it, so the provider sees it end
        (shut down first: a child forked meanwhile may hold the socket too)."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        answer = self._answer
        answer.parser = None
        if self._done and answer.complete and answer.framed and answer.keep_alive:
            if not answer.trailing:
                self._endpoint._give_back(sock)
                return
        elif not self._done:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def _decoder(encoding: str | None) -> Any:
    """A decompressor for a gzip or deflate body (sent though the request asked for
    ``identity``), None for a plain one."""
    name = (encoding or "").strip().lower()
    if name in ("", "identity"):
        return None
    if name in ("gzip", "x-gzip"):
        return zlib.decompressobj(zlib.MAX_WBITS | 16)
    if name == "deflate":
        return _Deflate()
    raise TransportError("answer in an unsupported content encoding")


def _decompress(decoder: Any, piece: bytes) -> bytes:
    try:
        return bytes(decoder.decompress(piece))
    except zlib.error as exc:
        raise TransportError("answer not decodable") from exc


class _Deflate:
    """``deflate`` as servers send it: zlib-wrapped as the standard says, or raw (as
    some do; urllib3 reads both)."""

    def __init__(self) -> None:
        self._inner = zlib.decompressobj()
        self._first = True

    def decompress(self, data: bytes) -> bytes:
        if self._first and data:
            self._first = False
            try:
                return self._inner.decompress(data)
            except zlib.error:
                self._inner = zlib.decompressobj(-zlib.MAX_WBITS)
        return self._inner.decompress(data)

    def flush(self) -> bytes:
        return self._inner.flush()

    @property
    def eof(self) -> bool:
        return self._inner.eof


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
        default_port = parts.port in (None, _DEFAULT_PORTS[parts.scheme])
        self._host_header = host if default_port else f"{host}:{self._port}"
        self._idle: collections.deque[socket.socket] = collections.deque()
        _ENDPOINTS.add(self)
        self._headers: dict[str, str] | None = None
        self._head: bytes | None = None  # the client's header lines, once encoded
        self._names: frozenset[str] = _OWN_HEADERS
        self._lock = threading.Lock()

    def _base_headers(self) -> dict[str, str]:
        if self._headers is None:
            with self._lock:
                if self._headers is None:
                    merged = {**self._client.default_headers, **self._client.auth_headers}
                    headers = {k: v for k, v in merged.items() if isinstance(v, str)}
                    try:
                        self._head = _header_lines(self._host_header, headers, {})
                    except ValueError:  # each request says so (post_stream), none is sent
                        self._head = None
                    self._names = frozenset(k.lower() for k in headers) | _OWN_HEADERS
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
        written = self._request_head(route, headers)
        if isinstance(written, str):  # raised here, outside the handler: no context kept
            raise self._unsendable(url, written)
        path, head = written
        if timeout_s <= 0:  # no time left: not sent (a zero time-out would not block)
            cause = NotConnected("no time left to connect")
            raise self._timeout_error(request=httpx2.Request("POST", url)) from cause
        message = b"".join(
            (
                b"POST ",
                path,
                b" HTTP/1.1\r\n",
                head,
                b"Accept-Encoding: identity\r\nContent-Length: ",
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
            response = LeanResponse(self, sock, parser, answer, url)
        except TimeoutError as exc:
            _drop(sock, answer)
            raise self._timeout_error(request=httpx2.Request("POST", url)) from exc
        except (OSError, TransportError, *_PARSER_ERRORS) as exc:
            _drop(sock, answer)
            failure = (
                exc
                if isinstance(exc, TransportError)
                else TransportError(f"connection lost ({type(exc).__name__})")
            )
            raise self._connection_error(request=httpx2.Request("POST", url)) from failure
        except BaseException:  # a time limit, an interrupt: the connection goes with it
            _drop(sock, answer)
            raise
        if response.status_code >= 400:
            try:
                content = b"".join(response.iter_bytes())
            except TransportError as exc:
                raise self._connection_error(request=response.request) from exc
            finally:
                response.close()
            answer_read = httpx2.Response(
                response.status_code,
                # Decoded here if it could be: not again by the SDK's response.
                headers=[
                    (k, v)
                    for k, v in answer.headers.items()
                    if k != "content-encoding" or response._decoder is None
                ],
                content=content,
                request=response.request,
            )
            raise self._client._make_status_error_from_response(answer_read)
        return response

    def _request_head(self, route: str, headers: Mapping[str, str]) -> tuple[bytes, bytes] | str:
        """The request's target and header lines, or the kind of error (its class's
        name) that keeps them from being written: a header this request cannot carry
        (an API key with a newline). Its text may quote the key: it goes no further."""
        base = self._base_headers()
        try:
            if self._head is None or any(k.lower() in self._names for k in headers):
                # the call's own headers replace the client's of the same name
                head = _header_lines(self._host_header, base, headers)
            else:
                head = self._head + _header_lines(None, {}, headers)
            return (self._path + route).encode("ascii"), head
        except ValueError as exc:
            return type(exc).__name__

    def _unsendable(self, url: str, kind: str) -> Exception:
        """The SDK's connection error for a request that cannot be written, its cause
        naming the kind of failure only."""
        error = self._connection_error(request=httpx2.Request("POST", url))
        error.__cause__ = httpx2.LocalProtocolError(f"request not sendable ({kind})")
        return error

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
        except UnicodeError as exc:  # a host name IDNA cannot encode: the configuration's
            raise self._unsendable(url, type(exc).__name__)  # noqa: B904 (its cause set)
        except OSError as exc:  # refused, unreachable, unknown host, connect time-out
            raise self._not_connected(url, "no connection", exc)  # noqa: B904 (its cause set)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl_context is not None:
                # An unclean end of a TLS session is an error, not the end of a body.
                sock = self._ssl_context.wrap_socket(
                    sock, server_hostname=self._host, suppress_ragged_eofs=False
                )
        except OSError as exc:  # the handshake (a certificate refused): nothing sent
            sock.close()
            raise self._not_connected(url, "no TLS session", exc)  # noqa: B904 (its cause set)
        except BaseException:
            sock.close()
            raise
        return sock

    def _not_connected(self, url: str, what: str, exc: OSError) -> Exception:
        """The SDK's connection error for a connection never made (nothing sent), its
        cause :class:`NotConnected` over the socket's error."""
        cause = NotConnected(f"{what} ({type(exc).__name__})")
        cause.__cause__ = exc
        error = self._connection_error(request=httpx2.Request("POST", url))
        error.__cause__ = cause
        return error

    def _give_back(self, sock: socket.socket) -> None:
        if len(self._idle) < _POOL_MAXSIZE:
            self._idle.append(sock)
        else:
            sock.close()


def _drop(sock: socket.socket, answer: _Answer) -> None:
    """Close a connection whose exchange failed before its answer was handed on."""
    answer.parser = None
    sock.close()


# Every endpoint of the process: a child forked from it starts with no idle
# connection of its parent's (two processes must never share one).
_ENDPOINTS: weakref.WeakSet[LeanEndpoint] = weakref.WeakSet()


def _forget_parents_connections() -> None:
    for lean in list(_ENDPOINTS):
        lean._idle = collections.deque()  # the parent's sockets stay open in the parent


os.register_at_fork(after_in_child=_forget_parents_connections)


def _still_open(sock: socket.socket) -> bool:
    """An idle connection can take a request: nothing to read on it (a readable idle
    socket is one the provider closed, or one with stray bytes: either is dropped)."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return False
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError):  # closed meanwhile
        return False


def _header_lines(host: str | None, first: Mapping[str, str], then: Mapping[str, str]) -> bytes:
    """``Name: value`` lines: ``Host`` (when given), then ``first`` updated by ``then``
    (a name of ``then`` replaces ``first``'s whatever its case), the names this module
    writes itself left out; latin-1, as http.client writes them. ValueError for a name
    or value a request cannot carry."""
    merged = first
    if then:
        names = {name.lower() for name in then}
        merged = {k: v for k, v in first.items() if k.lower() not in names} | dict(then)
    lines = [f"Host: {host}\r\n"] if host is not None else []
    for name, value in merged.items():
        if not _HEADER_NAME.fullmatch(name) or _BAD_VALUE.search(value):
            raise ValueError("header not allowed in a request")
        if name.lower() not in _OWN_HEADERS:
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
