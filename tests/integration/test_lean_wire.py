"""The lean path's HTTP/1.1 exchange (batchgen.providers.lean_http) against a real TCP
server that answers as scripted: framings, kept-alive connections and the ones a
provider closes, cut and stalled answers, what is sent and what never is.

The provider simulator speaks well-formed HTTP from one server (aiohttp); the answers
here are the other ones a provider or a proxy in front of it may give.
"""

from __future__ import annotations

import gzip
import os
import socket
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import openai
import pytest

from batchgen.providers import lean_http
from batchgen.providers.base import never_sent
from tests.waiting import wait_until

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
STREAM = b'data: {"a": 1}\n\ndata: [DONE]\n\n'


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


OK_CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Request-Id: r1\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(STREAM[:9], STREAM[9:])
)
OK_LENGTH = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(STREAM), STREAM)


@dataclass
class Exchange:
    """What the server does with one request: send ``answer`` (``None``: nothing),
    then close the connection, stall until the test ends, or wait for the next."""

    answer: bytes | None
    then: str = "keep"  # keep | close | stall


@dataclass
class ScriptedServer:
    """A TCP server answering each request it reads with the next scripted exchange."""

    script: list[Exchange]
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    closed_by_client: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> int:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()
        return int(self._listener.getsockname()[1])

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buffer = b""
            while True:
                request, buffer = _read_request(conn, buffer)
                if request is None:
                    self.closed_by_client += 1
                    return
                self.requests.append(request)
                step = self.script.pop(0) if self.script else Exchange(OK_LENGTH)
                if step.answer:
                    conn.sendall(step.answer)
                if step.then == "close":
                    return
                if step.then == "stall":
                    self._stop.wait()
                    return


def _read_request(conn: socket.socket, buffer: bytes) -> tuple[bytes | None, bytes]:
    """One request (head and body by its Content-Length), or None at the client's end."""
    while b"\r\n\r\n" not in buffer:
        data = conn.recv(65536)
        if not data:
            return None, b""
        buffer += data
    head, _, rest = buffer.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        data = conn.recv(65536)
        if not data:
            return None, b""
        rest += data
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


@pytest.fixture
def serve() -> Iterator[Callable[..., tuple[ScriptedServer, lean_http.LeanEndpoint]]]:
    servers: list[ScriptedServer] = []

    def start(*script: Exchange) -> tuple[ScriptedServer, lean_http.LeanEndpoint]:
        server = ScriptedServer(list(script))
        port = server.start()
        servers.append(server)
        url = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=url, api_key="sk-t", max_retries=0)
        lean = lean_http.endpoint(client, True)
        assert lean is not None
        return server, lean

    yield start
    for server in servers:
        server.stop()


def _read(lean: lean_http.LeanEndpoint, timeout_s: float = 5.0) -> tuple[bytes, object]:
    response = lean.post_stream("/chat/completions", BODY, {}, timeout_s)
    try:
        return b"".join(response.iter_bytes()), response.headers
    finally:
        response.close()


@pytest.mark.parametrize(
    "answer",
    [
        OK_CHUNKED,
        OK_LENGTH,
        # No length, not chunked: the body ends with the connection.
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + STREAM,
        # Sent compressed though the request asked for identity.
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
        % (len(gzip.compress(STREAM)), gzip.compress(STREAM)),
    ],
    ids=["chunked", "length", "until-close", "gzip"],
)
def test_every_framing_gives_the_body_as_sent(serve, answer: bytes) -> None:
    until_close = b"Content-Length" not in answer and b"chunked" not in answer
    server, lean = serve(Exchange(answer, "close" if until_close else "keep"))
    body, _ = _read(lean)
    assert body == STREAM


def test_a_kept_alive_connection_carries_the_next_call(serve) -> None:
    server, lean = serve(Exchange(OK_CHUNKED), Exchange(OK_LENGTH), Exchange(OK_CHUNKED))
    for _ in range(3):
        assert _read(lean)[0] == STREAM
    assert server.connections == 1 and len(server.requests) == 3


def test_headers_are_read_whatever_their_case(serve) -> None:
    _, lean = serve(Exchange(OK_CHUNKED))
    _, headers = _read(lean)
    assert headers["x-request-id"] == headers.get("X-REQUEST-ID") == "r1"  # type: ignore[index,attr-defined]
    assert "X-Request-ID" in headers  # type: ignore[operator]


def test_a_connection_the_provider_closed_is_not_used_again(serve) -> None:
    """An answer that keeps the connection, then the provider closes it while idle (its
    keep-alive time-out): the next call goes on a new one, nothing is sent twice."""
    server, lean = serve(Exchange(OK_LENGTH, "close"), Exchange(OK_LENGTH))
    assert _read(lean)[0] == STREAM
    wait_until(lambda: len(server.requests) == 1, 10, "the first call served")
    # The server's side has closed: the client sees it readable (EOF) once it arrives.
    wait_until(lambda: not lean_http._still_open(lean._idle[0]), 10, "the close seen")
    assert _read(lean)[0] == STREAM
    assert server.connections == 2 and len(server.requests) == 2


def test_connection_close_is_honoured(serve) -> None:
    answer = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (
        len(STREAM),
        STREAM,
    )
    server, lean = serve(Exchange(answer, "close"), Exchange(OK_LENGTH))
    assert _read(lean)[0] == STREAM
    assert not lean._idle
    assert _read(lean)[0] == STREAM
    assert server.connections == 2


def test_a_body_cut_short_raises_mid_stream(serve) -> None:
    """The status line came (the call may be billed), then the connection ended inside
    a chunked body: the iterator raises, the connection is not kept."""
    cut = OK_CHUNKED[: OK_CHUNKED.index(b"\r\n\r\n") + 4] + b'9\r\ndata: {"a\r\n'
    _, lean = serve(Exchange(cut, "close"))
    response = lean.post_stream("/chat/completions", BODY, {}, 5.0)
    assert response.status_code == 200
    with pytest.raises(lean_http.TransportError, match="before the end of the body"):
        b"".join(response.iter_bytes())
    response.close()
    assert not lean._idle


def test_a_stalled_body_times_out_per_read(serve) -> None:
    stalled = OK_CHUNKED[: OK_CHUNKED.index(b"\r\n\r\n") + 4]
    _, lean = serve(Exchange(stalled, "stall"))
    response = lean.post_stream("/chat/completions", BODY, {}, 0.3)
    with pytest.raises(lean_http.TransportError, match="read timed out"):
        list(response.iter_bytes())
    response.close()


def test_no_status_line_in_time_is_the_sdks_timeout(serve) -> None:
    _, lean = serve(Exchange(None, "stall"))
    with pytest.raises(openai.APITimeoutError) as err:
        _read(lean, timeout_s=0.3)
    assert not never_sent(err.value)  # the request went: it may be billed


@pytest.mark.parametrize(
    "answer", [b"SSH-2.0-OpenSSH_9.6\r\n\r\n", None], ids=["not-http", "closed-at-once"]
)
def test_no_answer_is_the_sdks_connection_error_and_maybe_sent(serve, answer) -> None:
    _, lean = serve(Exchange(answer, "close"))
    with pytest.raises(openai.APIConnectionError) as err:
        _read(lean)
    assert isinstance(err.value.__cause__, lean_http.TransportError)
    assert not never_sent(err.value)


def test_a_refused_connection_was_never_sent() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
    lean = lean_http.endpoint(client, True)
    assert lean is not None
    with pytest.raises(openai.APIConnectionError) as err:
        _read(lean)
    assert isinstance(err.value.__cause__, lean_http.NotConnected) and never_sent(err.value)


def test_an_error_status_is_the_sdks_typed_error_and_the_connection_stays(serve) -> None:
    error = b'{"error": {"message": "slow down", "type": "rate_limit", "code": "rate"}}'
    answer = (
        b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 2\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(error), error)
    )
    server, lean = serve(Exchange(answer), Exchange(OK_LENGTH))
    with pytest.raises(openai.RateLimitError) as err:
        _read(lean)
    assert err.value.response.headers["retry-after"] == "2"
    assert err.value.code == "rate"
    assert _read(lean)[0] == STREAM
    assert server.connections == 1


def test_the_request_is_written_once_with_its_framing(serve) -> None:
    server, lean = serve(Exchange(OK_LENGTH))
    _read(lean)
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
    names = [line.split(b":", 1)[0].lower() for line in lines[1:]]
    assert len(names) == len(set(names))  # no header twice (one Content-Type)
    fields = {line.split(b":", 1)[0].lower(): line.split(b":", 1)[1].strip() for line in lines[1:]}
    assert fields[b"host"] == f"127.0.0.1:{lean._port}".encode()
    assert fields[b"content-length"] == str(len(body)).encode()
    assert fields[b"authorization"] == b"Bearer sk-t"
    assert fields[b"content-type"] == b"application/json"
    assert fields[b"accept-encoding"] == b"identity"


def test_a_call_header_replaces_the_clients_own(serve) -> None:
    server, lean = serve(Exchange(OK_LENGTH))
    response = lean.post_stream("/chat/completions", BODY, {"authorization": "Bearer other"}, 5)
    b"".join(response.iter_bytes())
    response.close()
    head = server.requests[0].split(b"\r\n\r\n")[0].lower()
    assert head.count(b"authorization:") == 1 and b"bearer other" in head


@pytest.mark.parametrize(
    "headers",
    [
        {"x-key": "a\r\nInjected: yes"},
        {"bad name": "v"},
        {"X-A\n": "v"},
        {"x-key": "naïve ☃"},
    ],
    ids=["line-break", "name", "name-line-break", "not-latin-1"],
)
def test_a_header_a_request_cannot_carry_sends_nothing(serve, headers) -> None:
    server, lean = serve()
    with pytest.raises(openai.APIConnectionError) as err:
        lean.post_stream("/chat/completions", BODY, headers, 5.0)
    assert type(err.value.__cause__).__name__ == "LocalProtocolError"
    assert server.connections == 0 and not server.requests


def test_a_stream_closed_early_ends_its_connection(serve) -> None:
    """A cancel mid-answer: the provider sees the connection end."""
    stalled = OK_CHUNKED[: OK_CHUNKED.index(b"\r\n\r\n") + 4] + _chunked(STREAM)[:20]
    server, lean = serve(Exchange(stalled, "keep"))
    response = lean.post_stream("/chat/completions", BODY, {}, 5.0)
    next(response.iter_bytes())
    response.close()
    wait_until(lambda: server.closed_by_client == 1, 10, "the connection's end seen")
    assert not lean._idle


def test_a_forked_child_starts_without_its_parents_connections(serve) -> None:
    _, lean = serve(Exchange(OK_LENGTH))
    assert _read(lean)[0] == STREAM
    assert len(lean._idle) == 1
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: say how many idle connections it has, and go
        os.write(write_end, str(len(lean._idle)).encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as child:
        assert child.read() == b"0"
    assert len(lean._idle) == 1  # the parent's stays, usable
    assert _read(lean)[0] == STREAM


@pytest.mark.parametrize(
    "interim",
    [
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n",
    ],
    ids=["100", "103"],
)
def test_an_interim_answer_is_skipped_for_the_final_one(serve, interim: bytes) -> None:
    _, lean = serve(Exchange(interim + OK_CHUNKED))
    body, headers = _read(lean)
    assert body == STREAM
    assert "link" not in headers and headers["x-request-id"] == "r1"  # type: ignore[operator,index]
    assert len(lean._idle) == 1  # the final answer's connection, kept


def _gzip_answer(payload: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (
        len(payload),
        payload,
    )


@pytest.mark.parametrize(
    "payload",
    [b"\x1f\x8b\x08\x00garbage-not-deflate", gzip.compress(STREAM)[:-12]],
    ids=["corrupt", "cut-short"],
)
def test_a_compressed_body_that_does_not_decode_raises(serve, payload: bytes) -> None:
    _, lean = serve(Exchange(_gzip_answer(payload)))
    response = lean.post_stream("/chat/completions", BODY, {}, 5.0)
    with pytest.raises(lean_http.TransportError):
        b"".join(response.iter_bytes())
    response.close()
    assert not lean._idle


@pytest.mark.parametrize("wrapped", [True, False], ids=["zlib", "raw"])
def test_deflate_is_read_wrapped_or_raw(serve, wrapped: bool) -> None:
    packer = zlib.compressobj(wbits=zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
    payload = packer.compress(STREAM) + packer.flush()
    answer = b"HTTP/1.1 200 OK\r\nContent-Encoding: deflate\r\nContent-Length: %d\r\n\r\n%s" % (
        len(payload),
        payload,
    )
    _, lean = serve(Exchange(answer))
    assert _read(lean)[0] == STREAM


def test_bytes_after_the_answer_are_not_read_into_it(serve) -> None:
    """A second answer in the same read (a confused proxy): the first is the answer,
    and the connection is not used again."""
    server, lean = serve(Exchange(OK_LENGTH + b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nEVIL"))
    body, headers = _read(lean)
    assert body == STREAM and headers["content-length"] == str(len(STREAM))  # type: ignore[index]
    assert not lean._idle
    assert _read(lean)[0] == STREAM and server.connections == 2


def test_no_time_left_sends_nothing(serve) -> None:
    server, lean = serve(Exchange(OK_LENGTH), Exchange(OK_LENGTH))
    assert _read(lean)[0] == STREAM  # an idle connection is ready
    with pytest.raises(openai.APITimeoutError) as err:
        _read(lean, timeout_s=0.0)
    assert never_sent(err.value)
    assert len(server.requests) == 1


def test_an_upgrade_answer_is_a_connection_error(serve) -> None:
    _, lean = serve(Exchange(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n", "close"))
    with pytest.raises(openai.APIConnectionError) as err:
        _read(lean)
    assert isinstance(err.value.__cause__, lean_http.TransportError)


def test_the_framing_headers_are_the_modules_own(serve) -> None:
    server, lean = serve(Exchange(OK_LENGTH))
    own = {"Content-Length": "1", "Host": "elsewhere", "Transfer-Encoding": "chunked"}
    response = lean.post_stream("/chat/completions", BODY, own, 5.0)
    b"".join(response.iter_bytes())
    response.close()
    head = server.requests[0].split(b"\r\n\r\n")[0].lower()
    assert head.count(b"content-length:") == 1 and b"content-length: 1\r" not in head
    assert head.count(b"host:") == 1 and b"elsewhere" not in head
    assert b"transfer-encoding" not in head


def test_an_error_in_an_unknown_encoding_keeps_its_status(serve) -> None:
    """A 429 whose body came in an encoding this path does not read is still the SDK's
    rate-limit error (its body left as it came)."""
    answer = (
        b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\nContent-Encoding: br\r\n"
        b"Content-Length: 4\r\n\r\n\x0b\x01\x80{"
    )
    _, lean = serve(Exchange(answer))
    with pytest.raises(openai.RateLimitError) as err:
        _read(lean)
    assert err.value.response.headers["retry-after"] == "3"
