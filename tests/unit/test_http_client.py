"""The tests' shared HTTP client (tests/http_client.py) keeps nothing between requests,
as ``httpx.get()`` and its siblings do."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from tests import http_client


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = (self.headers.get("Cookie") or "-").encode()
        self.send_response(200)
        self.send_header("Set-Cookie", "session=signed-in; Path=/")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_cookie_set_by_one_request_is_not_sent_with_the_next(server: str):
    first = http_client.get(server)
    assert first.cookies.get("session") == "signed-in"  # the answer still shows it
    assert http_client.get(server).text == "-"


def test_a_cookie_given_to_a_request_is_sent_with_it(server: str):
    assert http_client.get(server, headers={"Cookie": "a=1"}).text == "a=1"
