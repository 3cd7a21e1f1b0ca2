"""The hot path's JSON (batchgen.json_codec): the standard library's values, faster,
and the standard library's answer wherever orjson refuses."""

from __future__ import annotations

import json
import math

import pytest

from batchgen import json_codec

CHUNK = (
    b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1765000000,'
    b'"model":"m","system_fingerprint":null,"choices":[{"index":0,"delta":'
    b'{"content":" caf\\u00e9 \xf0\x9f\x99\x82 \\"q\\""},"logprobs":null,'
    b'"finish_reason":null}],"usage":{"prompt_tokens":12,"completion_tokens":3,'
    b'"cost":1.5e-07}}'
)


def test_it_reads_what_the_standard_library_reads() -> None:
    assert json_codec.loads(CHUNK) == json.loads(CHUNK)
    assert json_codec.loads(CHUNK.decode()) == json.loads(CHUNK)


@pytest.mark.parametrize(
    "text",
    ['"\\ud83d"', '{"a": NaN}', "[1, -Infinity]"],
    ids=["lone-surrogate", "nan", "infinity"],
)
def test_what_orjson_refuses_the_standard_library_reads(text: str) -> None:
    got, want = json_codec.loads(text), json.loads(text)
    assert repr(got) == repr(want)  # NaN != NaN: compare as written


def test_an_integer_past_64_bits_reads_as_a_float_as_in_javascript() -> None:
    assert json_codec.loads("123456789012345678901234567890") == 1.2345678901234568e29
    assert json_codec.loads(str(2**63 - 1)) == 2**63 - 1


def test_malformed_json_raises_the_standard_librarys_error() -> None:
    with pytest.raises(json.JSONDecodeError):
        json_codec.loads(b'{"delta": {')


def test_it_writes_compact_utf8_json_that_reads_back_the_same() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": 'café 🙂 "q"\n'}],
        "max_tokens": 20,
        "temperature": 0.7,
        "stream": True,
        "n": None,
    }
    data = json_codec.dumps(body)
    assert data == json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    assert json.loads(data) == body
    assert "café".encode() in data  # not \u-escaped


def test_what_orjson_will_not_write_the_standard_library_writes() -> None:
    assert json.loads(json_codec.dumps({1: "a"})) == {"1": "a"}
    assert json.loads(json_codec.dumps([2**70])) == [2**70]
    assert math.isnan(
        json.loads(json_codec.dumps({"x": float("nan")}).replace(b"null", b"NaN"))["x"]
    )
