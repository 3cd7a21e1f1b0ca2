"""JSON on the hot path (a stream's chunks, the request body, the answer stored):
orjson, which reads and writes the same values as the standard library, several
times faster. Where orjson refuses what the standard library accepts (a lone
surrogate or ``NaN`` in what a provider sent; writing, an integer past 64 bits or a
key that is not a string) the standard library answers, or raises its own error, as
before. One difference is left: an integer past 64 bits in what is read comes back
as a float (as JavaScript reads it; no provider's field holds one)."""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(data: bytes | str) -> Any:
    """``json.loads(data)``, read by orjson where it can."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def dumps(obj: Any) -> bytes:
    """``obj`` as compact JSON in UTF-8 (no ASCII escapes), written by orjson where it
    can."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError: a key or value orjson does not write
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
