"""Request bodies read under a bound, and only once the caller is known.

The interfaces (:mod:`batchgen.api`, :mod:`batchgen.dashboard`) authenticate from the
headers first, then cap the body (:func:`cap_body`) before anything reads it.
The cap is the request's ``max_content_length``: a declared ``Content-Length``
over it is refused before a byte is read, and a body without one (``Transfer-Encoding:
chunked``) is counted while it streams, so the read stops where the cap is passed,
whatever follows. Either way the answer is a 413 naming the limit
(:class:`~batchgen.errors.PayloadTooLarge`), and the server closes the connection
rather than read the rest (``Connection: close``, see :func:`close_if_unread`).

Werkzeug's multipart parser reads through the same capped stream: an upload spools to
disk at most the cap, never the whole of what was sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from flask import Response, request
from werkzeug.exceptions import RequestEntityTooLarge

from batchgen.errors import PayloadTooLarge

# What a multipart upload may add to the file itself (boundaries, the other fields).
MULTIPART_SLACK_BYTES = 64 * 1024
# How much of a body is read at a time when it is split into lines.
BODY_CHUNK_BYTES = 256 * 1024
# Where the request's environ keeps its cap's message.
CAP_MESSAGE = "batchgen.body_cap_message"


def cap_body(max_bytes: int, message: str | None = None) -> None:
    """Cap this request's body at ``max_bytes``: a declared length over it is refused
    now, a streamed one (no ``Content-Length``) as soon as its reading passes it, with
    ``message`` (default: "body larger than N bytes").

    Call it after the caller is authenticated and before the body is touched (the
    stream takes its cap when it is first opened)."""
    message = message or f"body larger than {max_bytes} bytes"
    length = request.content_length
    if length is not None and length > max_bytes:
        raise PayloadTooLarge(message)
    # One byte over: Werkzeug refuses a read *at* its cap, so a body of exactly
    # max_bytes ends there, and one byte more is refused.
    request.max_content_length = max_bytes + 1
    request.environ[CAP_MESSAGE] = message


def too_large() -> PayloadTooLarge:
    """The 413 of the request's cap (see :func:`cap_body`)."""
    return PayloadTooLarge(request.environ.get(CAP_MESSAGE, "body too large"))


@contextlib.contextmanager
def refused_over() -> Iterator[None]:
    """Werkzeug's bare 413 (the read passed the cap) as our precise one."""
    try:
        yield
    except RequestEntityTooLarge as exc:
        raise too_large() from exc


def read_body(max_bytes: int, message: str | None = None) -> bytes:
    """The whole body, read under ``max_bytes`` and kept (``request.form`` and
    ``get_json`` then parse these bytes)."""
    cap_body(max_bytes, message)
    with refused_over():
        data = request.get_data(cache=True, parse_form_data=False)
    # Werkzeug's read-it-all stops quietly at the cap (only a further read raises):
    # a body that filled the cap, one byte over the limit, is refused here.
    if len(data) > max_bytes:
        raise too_large()
    return data


def json_body(max_bytes: int) -> Any:
    """The body parsed as JSON (None when it is not JSON), read under ``max_bytes``."""
    read_body(max_bytes)
    return request.get_json(silent=True)


def body_lines(max_bytes: int) -> Iterator[bytes]:
    """The body's lines (see :func:`split_lines`), read under ``max_bytes``."""
    cap_body(max_bytes)
    return _refusing_lines(split_lines(request.stream, BODY_CHUNK_BYTES))


def _refusing_lines(lines: Iterator[bytes]) -> Iterator[bytes]:
    with refused_over():
        yield from lines


def split_lines(stream: Any, chunk_bytes: int) -> Iterator[bytes]:
    """``stream``'s lines (each with its newline, the last one as it ends), read in
    chunks of ``chunk_bytes`` (Werkzeug's request stream is unbuffered: its
    ``readline`` reads a byte at a time), never whole: memory holds one chunk and the
    line that spans it. A long line is gathered in parts and joined once (no copy per
    chunk)."""
    pending: list[bytes] = []
    while True:
        data = stream.read(chunk_bytes)
        if not data:
            break
        lines = data.split(b"\n")
        if len(lines) == 1:
            pending.append(data)
            continue
        pending.append(lines[0])
        yield b"".join(pending) + b"\n"
        for line in lines[1:-1]:
            yield line + b"\n"
        pending = [lines[-1]] if lines[-1] else []
    if pending:
        yield b"".join(pending)


def close_if_unread(response: Response) -> Response:
    """Ask the server to close the connection after an error answer to a request that
    sent a body: what is left of it is never read (a server that keeps the connection
    would read it all to find the next request)."""
    sent_body = (
        request.content_length or "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    )
    if response.status_code >= 400 and sent_body:
        response.headers["Connection"] = "close"
    return response
