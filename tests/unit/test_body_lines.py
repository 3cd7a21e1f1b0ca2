"""The HTTP API reads a JSONL body in chunks and splits it into the same lines a
line-at-a-time read gives, wherever the chunks cut (app/bodies.py)."""

from __future__ import annotations

import io

from hypothesis import given
from hypothesis import strategies as st

from batchgen.bodies import split_lines


@given(
    st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=30),
    st.booleans(),
    st.integers(min_value=1, max_value=64),
)
def test_chunked_lines_equal_readline(lines, final_newline, chunk_bytes):
    body = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    expected = list(iter(io.BytesIO(body).readline, b""))
    assert list(split_lines(io.BytesIO(body), chunk_bytes)) == expected


def test_crlf_and_a_last_line_without_newline():
    body = b'{"a": 1}\r\n{"b": 2}\r\n{"c": 3}'
    assert list(split_lines(io.BytesIO(body), 5)) == [b'{"a": 1}\r\n', b'{"b": 2}\r\n', b'{"c": 3}']
    assert list(split_lines(io.BytesIO(b""), 5)) == []
