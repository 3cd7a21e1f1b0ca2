"""Bounded bodies against a real ``batchgen api`` process (issue #27, items 2 and 3).

A raw socket sends a chunked body (no Content-Length) in pieces, far past the
limit. The answer (401 without a key, 413 past the cap) must arrive before the body
is all sent, and meanwhile the server's memory and its spooled temp files must
stay far below what was sent (sampled from /proc while the body streams)."""

from __future__ import annotations

import os
import re
import select
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from batchgen.dashboard import csrf_token
from batchgen.dashboard_auth import SESSION_COOKIE
from tests import http_client
from tests.helpers import chat_line, jsonl, make_tenant

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
LIMIT_BYTES = 1 * MIB  # BATCHGEN_MAX_BODY_BYTES of the server under test
CALL_LIMIT_BYTES = 256 * 1024  # BATCHGEN_MAX_CALL_BODY_BYTES
SENT_BYTES = 48 * MIB  # what the client offers
PIECE_BYTES = 64 * 1024
BOUNDARY = "bgboundary"


@pytest.fixture(scope="module")
def server(module_api_server, tmp_path_factory):
    """The API process (its pid, URL and temp dir), with small body limits."""
    spool = tmp_path_factory.mktemp("spool")
    url = module_api_server(
        {
            "BATCHGEN_MAX_BODY_BYTES": str(LIMIT_BYTES),
            "BATCHGEN_MAX_CALL_BODY_BYTES": str(CALL_LIMIT_BYTES),
            "TMPDIR": str(spool),
        }
    )
    port = urlsplit(url).port
    serving = [p for p in psutil.Process().children(recursive=True) if _listens(p, port)]
    # gunicorn's master and its worker share the listening socket: the worker (a child
    # of the master) reads the bodies.
    pids = {p.pid for p in serving}
    (proc,) = [p for p in serving if p.ppid() in pids] or serving
    return url, proc, spool


def _listens(proc: psutil.Process, port: int | None) -> bool:
    """``proc`` holds a socket listening on ``port``."""
    try:
        sockets = proc.net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in sockets)


@pytest.fixture
def key(clean_db):
    return make_tenant("acme")


@dataclass
class Peaks:
    """The server's peak RSS and peak bytes of open files under its temp dir."""

    proc: psutil.Process
    spool: Path
    rss_bytes: int = 0
    spooled_bytes: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def _spooled(self) -> int:
        total = 0
        fds = Path(f"/proc/{self.proc.pid}/fd")
        for fd in fds.iterdir():
            try:
                if os.readlink(fd).startswith(str(self.spool)):
                    total += os.stat(fd).st_size
            except OSError:
                pass  # closed meanwhile
        return total

    def run(self) -> None:
        while not self.stop.is_set():
            self.rss_bytes = max(self.rss_bytes, self.proc.memory_info().rss)
            self.spooled_bytes = max(self.spooled_bytes, self._spooled())
            self.stop.wait(0.005)  # sample until stopped


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _complete(answer: bytes) -> bool:
    """Whether ``answer`` holds a whole HTTP response (its head and Content-Length)."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False  # no length: read to the end of the connection


def send_chunked(
    url: str, path: str, headers: dict[str, str], head: bytes, filler: bytes
) -> tuple[int, bytes, int]:
    """POST ``head`` then ``filler`` repeated up to SENT_BYTES, chunked, piece by
    piece; returns (status, answer, bytes sent when the answer came)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    lines = [f"POST {path} HTTP/1.1", f"Host: {parts.netloc}", "Transfer-Encoding: chunked"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    sent = 0
    answer = b""
    try:
        first = _chunk(head) if head else b""  # an empty chunk would end the body
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + first)
        sent = len(head)
        piece = _chunk(filler * (PIECE_BYTES // len(filler)))
        while sent < SENT_BYTES:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            try:
                sock.sendall(piece)
            except OSError:  # the server closed its side: the answer is there
                break
            sent += PIECE_BYTES
        else:
            sock.sendall(b"0\r\n\r\n")
        while not _complete(answer):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    finally:
        sock.close()
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
    return status, answer, sent


def _measured(server, path, headers, head=b"", filler=b"x"):
    url, proc, spool = server
    rss_before = proc.memory_info().rss
    peaks = Peaks(proc, spool)
    sampler = threading.Thread(target=peaks.run)
    sampler.start()
    try:
        status, answer, sent = send_chunked(url, path, headers, head, filler)
    finally:
        peaks.stop.set()
        sampler.join()
    return status, answer, sent, peaks.rss_bytes - rss_before, peaks.spooled_bytes


def _assert_refused_early(sent, rss_growth, spooled):
    assert sent < SENT_BYTES // 4, f"answered only after {sent} bytes"
    assert rss_growth < 16 * MIB, f"RSS grew {rss_growth} bytes"
    assert spooled <= 2 * LIMIT_BYTES, f"spooled {spooled} bytes"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/messages/batches"])
def test_a_chunked_body_without_a_key_is_refused_unread(server, clean_db, path):
    status, answer, sent, rss_growth, spooled = _measured(
        server, path, {"Content-Type": "application/json"}, head=b'{"model": "', filler=b"x"
    )
    assert status == 401, answer[:300]
    _assert_refused_early(sent, rss_growth, spooled)


JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize(
    ("path", "head", "filler", "limit"),
    [
        (
            "/v1/chat/completions",
            b'{"model": "sim-small", "messages": [',
            b"{}, ",
            CALL_LIMIT_BYTES,
        ),
        ("/v1/messages", b'{"model": "sim-claude", "messages": [', b"{}, ", CALL_LIMIT_BYTES),
        ("/v1/messages/batches", b'{"requests": [', b"{}, ", LIMIT_BYTES),
        ("/v1/batches", b"", b"x", LIMIT_BYTES),  # one line that never ends
        ("/v1/batches", b"", b"\n", LIMIT_BYTES),
    ],
)
def test_a_chunked_body_past_its_cap_is_413_while_streaming(server, key, path, head, filler, limit):
    headers = {"Authorization": f"Bearer {key}"}
    if path != "/v1/batches":
        headers.update(JSON)
    status, answer, sent, rss_growth, spooled = _measured(server, path, headers, head, filler)
    assert status == 413, answer[:300]
    assert f"larger than {limit} bytes".encode() in answer
    _assert_refused_early(sent, rss_growth, spooled)


def _multipart_head(fields: dict[str, str]) -> bytes:
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
        for k, v in fields.items()
    ]
    parts.append(
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    )
    return "".join(parts).encode()


def test_a_file_upload_past_the_limit_is_413_before_it_is_spooled(server, key):
    headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": f"multipart/form-data; boundary={BOUNDARY}",
    }
    line = jsonl([chat_line("a", text="hi")])
    status, answer, sent, rss_growth, spooled = _measured(
        server, "/v1/files", headers, _multipart_head({"purpose": "batch"}), line
    )
    assert status == 413, answer[:300]
    assert f"larger than {LIMIT_BYTES} bytes".encode() in answer
    _assert_refused_early(sent, rss_growth, spooled)


def _dashboard_session(url: str, key: str) -> str:
    """Sign in as a browser does (the form's token and cookie, then the key); returns
    the session cookie's token."""
    with httpx.Client(base_url=url) as web:
        form = web.get("/dashboard")
        token = re.search(r'name="csrf" value="([^"]+)"', form.text)
        assert token, form.text[:300]
        signed_in = web.post("/dashboard/login", data={"key": key, "csrf": token.group(1)})
        assert signed_in.status_code == 302, signed_in.text[:300]
        return str(web.cookies[SESSION_COOKIE])


def test_a_dashboard_upload_past_the_limit_is_413_before_it_is_spooled(server, key):
    session = _dashboard_session(server[0], key)
    headers = {
        "Cookie": f"{SESSION_COOKIE}={session}",
        "Content-Type": f"multipart/form-data; boundary={BOUNDARY}",
    }
    line = jsonl([chat_line("a", text="hi")])
    head = _multipart_head({"csrf": csrf_token(session)})
    status, answer, sent, rss_growth, spooled = _measured(
        server, "/dashboard/submit", headers, head, line
    )
    assert status == 413, answer[:300]
    assert f"larger than {LIMIT_BYTES} bytes".encode() in answer
    _assert_refused_early(sent, rss_growth, spooled)


def test_bodies_within_the_caps_still_work(server, key):
    """The caps refuse only what is over them: a JSONL batch (whatever its content
    type) and an upload just under the limit, sent chunked, are taken."""
    url, _, _ = server
    auth = {"Authorization": f"Bearer {key}"}
    one = jsonl([chat_line("x", text="hi")])
    count = (LIMIT_BYTES - 4096) // (len(one) + 4)
    body = jsonl([chat_line(f"c{i:04d}", text="hi") for i in range(count)])
    assert LIMIT_BYTES // 2 < len(body) <= LIMIT_BYTES

    def pieces():
        for i in range(0, len(body), PIECE_BYTES):
            yield body[i : i + PIECE_BYTES]

    for content_type in ("application/jsonl", "application/json"):
        headers = {**auth, "Content-Type": content_type}
        res = http_client.post(f"{url}/v1/batches", content=pieces(), headers=headers, timeout=60)
        assert res.status_code == 200, (content_type, res.text)
        assert res.json()["request_counts"]["total"] == count
    files = {"file": ("ok.jsonl", body, "application/jsonl")}
    res = http_client.post(f"{url}/v1/files", files=files, data={"purpose": "batch"}, headers=auth)
    assert res.status_code == 200, res.text
    assert res.json()["bytes"] == len(body)


def test_a_dashboard_form_is_read_no_further_than_a_form(server, key):
    """The sign-in form needs no key: a chunked URL-encoded body (which Werkzeug
    reads whole) is cut at the dashboard's form cap; a real sign-in still works."""
    status, answer, sent, rss_growth, spooled = _measured(
        server,
        "/dashboard/login",
        {"Content-Type": "application/x-www-form-urlencoded"},
        head=b"key=",
        filler=b"x",
    )
    assert status == 413, answer[:300]
    assert b"larger than 65536 bytes" in answer
    _assert_refused_early(sent, rss_growth, spooled)
    url, _, _ = server
    assert _dashboard_session(url, key)
