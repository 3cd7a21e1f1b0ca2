"""An embeddings request (``POST /v1/embeddings``): its validation and its tokens (pure).

``input`` is what the API takes: a string, a list of strings, a list of token ids, or
a list of lists of token ids; no string empty, at most :data:`MAX_INPUTS` inputs, each
within the model's context window, and at most :data:`MAX_REQUEST_TOKENS` in all (the
bounds OpenAI documents for its embedding models). ``encoding_format`` is ``float`` or
``base64`` (the ``openai`` SDK asks for base64 and decodes it itself), ``dimensions``
at most the model's own.

An embedding has no output: its tokens are its inputs' tokens, counted as the text
alone (no per-message framing), a token-id input by its length.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from batchgen.domain.formats import tokens
from batchgen.errors import ValidationFailed
from batchgen.registry import ModelSpec

MAX_INPUTS = 2048
MAX_REQUEST_TOKENS = 300_000
ENCODING_FORMATS = ("float", "base64")

Input = str | list[int]
# An input and the path that names it (``body.input`` or ``body.input[3]``).
Named = tuple[str, Input]


def _fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(message, field=field)


def _token_ids(value: list[Any], field: str) -> list[int]:
    for i, token in enumerate(value):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise _fail(f"{field}[{i}]", "must be a token id (an integer >= 0)")
    return value


def inputs(body: Mapping[str, Any]) -> list[Named]:
    """The request's inputs, each a string or a list of token ids, with its path; raises
    :class:`ValidationFailed` naming the field."""
    value = body.get("input")
    if value is None:
        raise _fail("body.input", "is required")
    if isinstance(value, str):
        if not value:
            raise _fail("body.input", "must not be an empty string")
        return [("body.input", value)]
    if not isinstance(value, list) or not value:
        raise _fail(
            "body.input",
            "must be a string, a non-empty list of strings, or a list of token ids "
            "(or of lists of token ids)",
        )
    if len(value) > MAX_INPUTS:
        raise _fail("body.input", f"{len(value)} inputs: at most {MAX_INPUTS} in one request")
    first = value[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return [("body.input", _token_ids(value, "body.input"))]
    out: list[Named] = []
    for i, entry in enumerate(value):
        field = f"body.input[{i}]"
        if isinstance(first, str):
            if not isinstance(entry, str) or not entry:
                raise _fail(field, "must be a non-empty string (as every input of the list)")
            out.append((field, entry))
        elif isinstance(first, list):
            if not isinstance(entry, list) or not entry:
                raise _fail(field, "must be a non-empty list of token ids (as every input)")
            out.append((field, _token_ids(entry, field)))
        else:
            raise _fail(field, "must be a string, a token id or a list of token ids")
    return out


def check_options(body: Mapping[str, Any], spec: ModelSpec) -> None:
    """``encoding_format``, ``dimensions`` and ``user``, as the API takes them."""
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ENCODING_FORMATS:
        raise _fail("body.encoding_format", f"must be one of {', '.join(ENCODING_FORMATS)}")
    dims = body.get("dimensions")
    if dims is not None:
        most = spec.dimensions or 0
        if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= most:
            raise _fail("body.dimensions", f"must be an integer from 1 to {most} for {spec.name}")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _fail("body.user", "must be a string")


def count(entries: list[Named], spec: ModelSpec, spend: Callable[[int], None] | None = None) -> int:
    """The request's input tokens; refuses an input over the model's context window
    (by its byte length first, without tokenizing it) and a request over
    :data:`MAX_REQUEST_TOKENS`. ``spend`` is told the bytes of each text counted."""
    window, total = spec.context_window, 0
    for field, entry in entries:
        if isinstance(entry, list):
            n = len(entry)
        else:
            size = len(entry.encode("utf-8", "surrogatepass"))
            n = tokens.min_tokens(size, spec.encoding)
            if n <= window:
                if spend is not None:
                    spend(size)
                n = tokens.count_text(entry, spec.encoding, limit=window)
        if n > window:
            raise _fail(
                field,
                f"an input of more than {window} tokens exceeds the context window of "
                f"{window} for {spec.name}",
            )
        total += n
    if total > MAX_REQUEST_TOKENS:
        raise _fail(
            "body.input", f"{total} tokens in all: at most {MAX_REQUEST_TOKENS} in one request"
        )
    return total
