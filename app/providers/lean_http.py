"""A streamed call's HTTP exchange on urllib3: the hot path of every OpenAI-compatible
and Anthropic item.

The SDK sends each request through its option models, header merging, URL joins and
httpx's client, transport and h11 layers. For one streamed chat call against a
provider that answers at once that is about 0.8 ms of CPU, where urllib3's pooled
connection and the same body cost about 0.35 ms; on a worker it was a quarter of all
the CPU an item costs. So the streamed call goes here, and the SDK still decides what
is sent and what an error is:

- the URL is the SDK client's ``base_url`` joined with the route, the headers its own
  (``default_headers``: user agent and platform headers; ``auth_headers``) plus the
  call's;
- an error answer (status >= 400) is read and handed to the SDK, which makes its typed
  error of it (``RateLimitError``, ``BadRequestError``... with body and headers), so
  :func:`batchgen.providers.openai.translate` maps it as before;
- a connection that cannot be had raises the SDK's ``APIConnectionError`` (or
  ``APITimeoutError``) with the urllib3 error as its cause;
- TLS verifies against the trust store the SDK's transport uses (httpcore's default
  context: ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``, else the system's).

A Responses API or embeddings call (a whole answer, not a stream) takes the same POST
and reads its body to the end. The same holds for the ``anthropic`` SDK's client (its
errors are its own: the SDK's ``APIConnectionError``, ``APITimeoutError`` and typed
status errors). Any other client (Azure's, one behind an HTTP proxy from the
environment) keeps the SDK's own path; ``BATCHGEN_LEAN_HTTP=false`` turns this off
everywhere.
"""

from __future__ import annotations

import functools
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpcore2
import httpx2
import openai
import urllib3
from urllib3.exceptions import HTTPError, NewConnectionError
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from batchgen import json_codec

__all__ = ["LeanEndpoint", "endpoint", "urllib3_errors"]

# Transport errors of urllib3 (a stream cut or stalled mid-body), for the adapters'
# ``except`` lists.
urllib3_errors: tuple[type[BaseException], ...] = (HTTPError,)

# An SDK's connection and time-out errors, each made with the request it is about.
SdkErrors = tuple[Callable[..., Exception], Callable[..., Exception]]

_POOL_MAXSIZE = 64  # connections kept per host; a worker's threads beyond it open more
_CHUNK_BYTES = 65536


class LeanResponse:
    """A streamed answer's status line and headers, and its body as it arrives."""

    __slots__ = ("_done", "_raw", "_url", "headers", "status_code")

    def __init__(self, raw: urllib3.BaseHTTPResponse, url: str) -> None:
        self._raw = raw
        self._url = url
        self._done = False
        self.status_code = raw.status
        self.headers: Mapping[str, str] = raw.headers

    @property
    def request(self) -> httpx2.Request:
        """The request, as the SDK's errors about this answer carry it."""
        return httpx2.Request("POST", self._url)

    def iter_bytes(self) -> Iterator[bytes]:
        """The body's bytes as they come (a chunk of a chunked body, or what one read
        returns), to its end."""
        raw = self._raw
        if raw.chunked:  # type: ignore[attr-defined]
            yield from raw.read_chunked(decode_content=True)  # type: ignore[attr-defined]
        else:
            while data := raw.read1(_CHUNK_BYTES):
                yield data
        self._done = True

    def close(self) -> None:
        """A body read to its end gives the connection back to the pool; a stream cut
        short (cancel, deadline, a bad chunk) closes it, so the provider sees it end."""
        if not self._done:
            self._raw.close()
        self._raw.release_conn()


class LeanEndpoint:
    """Streamed POSTs to one SDK client's ``base_url`` through one urllib3 connection pool.
    ``errors``: the SDK's connection and time-out error classes."""

    def __init__(self, client: Any, errors: SdkErrors) -> None:
        self._client = client
        self._connection_error, self._timeout_error = errors
        self._base = str(client.base_url).rstrip("/")
        self._path = urlsplit(self._base).path  # the pool is the host's: requests name a path
        tls: dict[str, Any] = {}
        if urlsplit(self._base).scheme == "https":  # the trust store the SDK's httpx uses
            tls["ssl_context"] = httpcore2.default_ssl_context()
        self._pool = urllib3.connection_from_url(
            self._base, maxsize=_POOL_MAXSIZE, retries=False, block=False, **tls
        )
        self._headers: dict[str, str] | None = None
        self._lock = threading.Lock()

    def _base_headers(self) -> dict[str, str]:
        if self._headers is None:
            with self._lock:
                merged = {**self._client.default_headers, **self._client.auth_headers}
                self._headers = {k: v for k, v in merged.items() if isinstance(v, str)}
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
        try:
            raw = self._pool.urlopen(
                "POST",
                self._path + route,
                body=data,
                headers={**self._base_headers(), **headers},
                preload_content=False,
                decode_content=True,
                redirect=False,
                retries=False,
                timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s),
            )
        except NewConnectionError as exc:  # refused, unreachable (a ConnectTimeoutError too)
            raise self._connection_error(request=httpx2.Request("POST", url)) from exc
        except Urllib3Timeout as exc:
            raise self._timeout_error(request=httpx2.Request("POST", url)) from exc
        except HTTPError as exc:
            raise self._connection_error(request=httpx2.Request("POST", url)) from exc
        except ValueError as exc:
            # http.client refusing a header (an API key with a newline) before sending:
            # its text quotes the header, so only the kind of failure goes on.
            unsent = httpx2.LocalProtocolError(f"request not sendable ({type(exc).__name__})")
            raise self._connection_error(request=httpx2.Request("POST", url)) from unsent
        response = LeanResponse(raw, url)
        if raw.status >= 400:
            try:
                content = raw.read()
            except HTTPError as exc:
                raise self._connection_error(request=response.request) from exc
            finally:
                raw.release_conn()
            answer = httpx2.Response(
                raw.status,
                # The body is decoded already: not again by the SDK's response.
                headers=[(k, v) for k, v in raw.headers.items() if k.lower() != "content-encoding"],
                content=content,
                request=response.request,
            )
            raise self._client._make_status_error_from_response(answer)
        return response


def _behind_proxy(url: str) -> bool:
    """True when the environment sends ``url`` through a proxy (the SDK's httpx honours
    ``HTTPS_PROXY`` and friends; urllib3 alone would not)."""
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
    return LeanEndpoint(client, errors)


def endpoint(client: Any, enabled: bool) -> LeanEndpoint | None:
    """The lean path for ``client`` (one per client and process), or None: turned off,
    not a plain OpenAI or Anthropic client (Azure's routes differ), a base URL with a
    query or a scheme other than http(s), or behind a proxy."""
    return _endpoint_for(client) if enabled else None
