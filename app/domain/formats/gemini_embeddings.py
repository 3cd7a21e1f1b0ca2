"""An OpenAI embeddings body as a Gemini ``embedContent`` request, and its answer as
an OpenAI embeddings list (pure).

Taken: ``input`` as a string or a list of strings (one content each), ``dimensions``
(Gemini's ``output_dimensionality``), ``encoding_format`` (``float``, or ``base64``
written here from the floats) and ``user`` (left out). Token-id inputs have no Gemini
equivalent and are refused, naming the field, as is any other field.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from batchgen.domain.formats.chat import Untranslatable

_TAKEN = frozenset({"model", "input", "dimensions", "encoding_format", "user"})


def texts(body: Mapping[str, Any], kind: str) -> list[str]:
    """The texts to embed (raises :class:`Untranslatable` naming the field)."""
    for key in body:
        if key not in _TAKEN:
            raise Untranslatable(f"body.{key}", f"has no equivalent on a {kind} model")
    value = body.get("input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise Untranslatable("body.input", f"a {kind} model embeds text: token ids have no equivalent")


def refusal(body: Mapping[str, Any], kind: str) -> Untranslatable | None:
    """Why ``body`` cannot be embedded by a model of ``kind`` (None: it can)."""
    try:
        texts(body, kind)
    except Untranslatable as exc:
        return exc
    return None


def config(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``EmbedContentConfig`` of the body."""
    dims = body.get("dimensions")
    return {} if dims is None else {"output_dimensionality": int(dims)}


def _encoded(values: Sequence[float], fmt: Any) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return list(values)


def embeddings_list(
    vectors: Sequence[Sequence[float]], model: str, prompt_tokens: int, body: Mapping[str, Any]
) -> dict[str, Any]:
    """The vectors as OpenAI's ``{"object": "list", "data": [...], "usage"}``."""
    fmt = body.get("encoding_format")
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, fmt)}
        for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}
