"""Deterministic completion text of the simulator.

The answer to a list of messages depends only on the messages: it starts with
``"[" + request_digest(messages) + "] "`` and continues with words from a fixed
English vocabulary drawn by ``random.Random(digest)``. Its natural length (in
tokens, digest prefix included) is drawn by the same RNG in ``[20, 120]``; a
smaller ``max_tokens`` truncates it (finish reason ``"length"``). The text
never echoes the prompt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from batchgen.domain.formats.tokens import count_text, get_encoding

NATURAL_MIN_TOKENS = 20
NATURAL_MAX_TOKENS = 120

# Every " word" here is a single cl100k_base token (checked by the unit tests).
VOCABULARY: tuple[str, ...] = tuple(
    """the a of and to in is was for on with as by at from that this it be are or an
    which one all their there when time can more about would will into other some these
    may could than them only new also its two first over then after most where such like
    made through down back many before must well each under great much people world year
    years work way water place sound light long little house home small large line right
    old night hand side day part answer river mountain forest garden window table letter
    story question number city country road field stone tree bird music paper morning
    evening summer winter green blue quiet bright simple early clear warm open""".split()  # noqa: SIM905
)
_SENTENCE_END_P = 0.12
_PIECE_RE = re.compile(r"\S+\s*|\s+")


def request_digest(messages: Sequence[Mapping[str, Any]]) -> str:
    """First 16 hex chars of the SHA-256 of the canonical JSON of ``messages``."""
    canonical = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def anthropic_prompt_messages(
    system: str | list[Any] | None, messages: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The message list an Anthropic request is digested and counted as.

    A ``system`` prompt becomes a leading ``{"role": "system", "content": system}``.
    """
    head: list[Mapping[str, Any]] = [{"role": "system", "content": system}] if system else []
    return head + list(messages)


def natural_length(digest: str) -> int:
    """The natural completion length in tokens for ``digest`` (in [20, 120])."""
    return random.Random(digest).randint(NATURAL_MIN_TOKENS, NATURAL_MAX_TOKENS)


@functools.lru_cache(maxsize=4096)
def _completion_for_digest(digest: str, max_tokens: int, encoding: str) -> tuple[str, int, str]:
    rng = random.Random(digest)
    natural = rng.randint(NATURAL_MIN_TOKENS, NATURAL_MAX_TOKENS)
    words: list[str] = []
    for _ in range(natural):  # each word is >= 1 token, so this is always long enough
        word = rng.choice(VOCABULARY)
        words.append(word + "." if rng.random() < _SENTENCE_END_P else word)
    prefix = f"[{digest}] "
    budget = min(natural, max_tokens)
    finish = "length" if max_tokens < natural else "stop"
    if count_text(prefix, encoding) <= budget:
        # Sums need a real tokenizer (a bytes/4 estimate is not additive).
        additive = get_encoding(encoding) is not None
        if additive:
            text = _longest_within(prefix, words, budget, encoding)
            tokens = count_text(text, encoding)
            if tokens <= budget:
                return text, tokens, finish
        text = _search_longest(prefix, words, budget, encoding)
        return text, count_text(text, encoding), finish
    # Not even the digest prefix fits: the longest prefix of it that does.
    lo, hi = 0, len(prefix)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_text(prefix[:mid], encoding) <= budget:
            lo = mid
        else:
            hi = mid - 1
    text = prefix[:lo]
    return text, count_text(text, encoding), finish


@functools.lru_cache(maxsize=1024)
def _piece_tokens(piece: str, encoding: str) -> int:
    return count_text(piece, encoding)


def _longest_within(prefix: str, words: list[str], budget: int, encoding: str) -> str:
    """The longest ``prefix + " ".join(words[:k])`` of at most ``budget`` tokens, counted
    as sums: the tokenizer splits before each space-led word and each ".", so the count
    of the text is that of the prefix plus that of each " word" (and "."). The caller
    checks the sum with one count of the result."""
    used = _piece_tokens(prefix.rstrip(), encoding)
    k = 0
    while k < len(words):
        cost = _piece_tokens(" " + words[k], encoding)
        if used + cost > budget:
            break
        used += cost
        k += 1
    text = prefix + " ".join(words[:k])
    gap = k < len(words) and words[k].endswith(".")  # fill the gap the "." left
    if gap and used + _piece_tokens(" " + words[k][:-1], encoding) <= budget:
        text = prefix + " ".join(words[: k + 1])[:-1]
    return text


def _search_longest(prefix: str, words: list[str], budget: int, encoding: str) -> str:
    """:func:`_longest_within` by counting each candidate text whole (binary search)."""

    def text_with(k: int) -> str:
        return prefix + " ".join(words[:k])

    lo, hi = 0, len(words)  # largest k with count(text_with(k)) <= budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_text(text_with(mid), encoding) <= budget:
            lo = mid
        else:
            hi = mid - 1
    text = text_with(lo)
    if lo < len(words) and words[lo].endswith("."):  # fill the gap the "." left
        candidate = text_with(lo + 1)[:-1]
        if count_text(candidate, encoding) <= budget:
            text = candidate
    return text


def completion_text(
    messages: Sequence[Mapping[str, Any]], max_tokens: int, encoding: str = "cl100k_base"
) -> tuple[str, int, str]:
    """The simulated answer to ``messages``: ``(text, completion_tokens, finish_reason)``.

    ``completion_tokens == batchgen.domain.formats.tokens.count_text(text, encoding) <=
    max_tokens``;
    ``finish_reason`` is ``"length"`` when ``max_tokens`` cut the natural
    length short, else ``"stop"``.
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    return _completion_for_digest(request_digest(messages), max_tokens, encoding)


def split_chunks(text: str, words_per_chunk: int = 3) -> list[str]:
    """Split ``text`` into stream chunks of a few words; ``"".join(result) == text``."""
    pieces = _PIECE_RE.findall(text)
    chunks = [
        "".join(pieces[i : i + words_per_chunk]) for i in range(0, len(pieces), words_per_chunk)
    ]
    return chunks or [""]
