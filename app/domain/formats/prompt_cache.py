"""Prompt caching: the prefix a request shares with others, its key, and Anthropic's
cache breakpoint (pure).

Providers cache a prompt's prefix: OpenAI by itself once a prefix of 1024 tokens or
more repeats, Anthropic where the request marks a breakpoint (``cache_control``), both
for a few minutes. A nightly job's items share a long prefix (the system prompt with
its guidelines, the tools) and differ after it (the product's fields). So at admission
each item gets a **prefix key** (:class:`PrefixKeys`): a 64-bit hash of its model and
that prefix, kept only when the prefix is long enough to be cached
(``prompt_cache_min_tokens``) and shared by another item of its batch. The dispatcher
releases a tenant's items of one key together, and for Anthropic the call marks the
prefix with an ephemeral breakpoint (:func:`with_cache_breakpoint`) unless the request
has breakpoints of its own.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from batchgen.domain.formats.endpoints import CHAT_COMPLETIONS, MESSAGES, RESPONSES
from batchgen.domain.formats.message_batches import NATIVE_PARAMS
from batchgen.domain.formats.tokens import count_text

CACHE_CONTROL = "cache_control"
EPHEMERAL = {"type": "ephemeral"}
_LEADING_ROLES = frozenset({"system", "developer"})


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        return [t for t in parts if isinstance(t, str)]
    return []


def _leading(messages: Any) -> list[Any]:
    """The system (and developer) messages before the first user or assistant one."""
    head: list[Any] = []
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict) or message.get("role") not in _LEADING_ROLES:
            break
        head.append(message)
    return head


def shared_prefix(body: Mapping[str, Any], endpoint: str) -> tuple[dict[str, Any], str] | None:
    """``(prefix, its text)``: the part of a request that comes before what differs from
    one item to the next (tools, then the system prompt: the leading system or developer
    messages, a Messages request's ``system``, a Response's ``instructions``), or None
    when it has none. The text is what is counted against the cacheable minimum."""
    native = body.get(NATIVE_PARAMS)
    if isinstance(native, dict):
        prefix = {"tools": native.get("tools"), "system": native.get("system")}
        contents = [native.get("system")]
    elif endpoint == RESPONSES:
        head = _leading(body.get("input"))
        prefix = {"tools": body.get("tools"), "instructions": body.get("instructions")}
        prefix["input"] = head or None
        contents = [body.get("instructions"), *(m.get("content") for m in head)]
    elif endpoint in (CHAT_COMPLETIONS, MESSAGES):
        head = _leading(body.get("messages"))
        prefix = {"tools": body.get("tools"), "messages": head or None}
        contents = [m.get("content") for m in head]
    else:
        return None
    texts = [text for content in contents for text in _texts(content)]
    if prefix.get("tools"):
        texts.append(json.dumps(prefix["tools"], sort_keys=True))
    if not any(texts):
        return None
    return {k: v for k, v in prefix.items() if v}, "\n".join(texts)


def key_of(model: str, prefix: Mapping[str, Any]) -> int:
    """A prefix's key: the first 8 bytes of SHA-256 over the model and the prefix's
    canonical JSON, as a signed 64-bit integer (a ``bigint``)."""
    canonical = json.dumps(prefix, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.sha256(f"{model}\x00{canonical}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class PrefixKeys:
    """The prefix keys of one batch's items, as they are admitted.

    ``min_tokens(model)`` (None: the model keeps no keys) and ``encoding(model)`` come
    from the registry. A prefix is
    counted once per batch, and no further than the minimum (a long system prompt
    costs the tokenizer the minimum, once). :meth:`singles` names, after the last item,
    the keys only one item has: the store clears them (nothing to share)."""

    def __init__(
        self, min_tokens: Callable[[str], int | None], encoding: Callable[[str], str]
    ) -> None:
        self._min_tokens = min_tokens
        self._encoding = encoding
        self._long: dict[int, bool] = {}
        self.counts: Counter[int] = Counter()

    def key(self, model: str, body: Mapping[str, Any], endpoint: str) -> int | None:
        """The item's prefix key, or None (no prefix, or one too short to be cached)."""
        need = self._min_tokens(model)
        found = None if need is None else shared_prefix(body, endpoint)
        if found is None or need is None:
            return None
        prefix, text = found
        key = key_of(model, prefix)
        long = self._long.get(key)
        if long is None:
            # A token is at least one byte: a shorter text cannot reach the minimum.
            long = len(text.encode()) >= need and (
                count_text(text, self._encoding(model), limit=need) >= need
            )
            self._long[key] = long
        if not long:
            return None
        self.counts[key] += 1
        return key

    def singles(self) -> list[int]:
        """The keys of exactly one item so far."""
        return [key for key, n in self.counts.items() if n == 1]


def has_cache_control(value: Any) -> bool:
    """The request (or any part of it) already marks a cache breakpoint."""
    if isinstance(value, Mapping):
        return CACHE_CONTROL in value or any(has_cache_control(v) for v in value.values())
    if isinstance(value, list):
        return any(has_cache_control(v) for v in value)
    return False


def _marked(blocks: list[Any]) -> list[Any] | None:
    """``blocks`` with the breakpoint on the last one (None: it is no block object)."""
    if not blocks or not isinstance(blocks[-1], dict):
        return None
    return [*blocks[:-1], {**blocks[-1], CACHE_CONTROL: dict(EPHEMERAL)}]


def with_cache_breakpoint(params: dict[str, Any]) -> dict[str, Any]:
    """Anthropic Messages parameters with an ephemeral cache breakpoint at the end of
    the shared prefix: on the system prompt (a string becomes one text block), or on
    the last tool when there is no system prompt. Unchanged when the request marks a
    breakpoint of its own anywhere, or has neither. Not changed in place."""
    if has_cache_control(params):
        return params
    system = params.get("system")
    if isinstance(system, str) and system:
        return {**params, "system": [{"type": "text", "text": system, CACHE_CONTROL: EPHEMERAL}]}
    if isinstance(system, list) and system:
        marked = _marked(system)
        return params if marked is None else {**params, "system": marked}
    tools = params.get("tools")
    if isinstance(tools, list) and tools:
        marked = _marked(tools)
        return params if marked is None else {**params, "tools": marked}
    return params
