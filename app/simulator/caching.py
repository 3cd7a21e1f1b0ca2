"""The providers' prompt caches, simulated: which prefixes are warm, for how long.

A provider keeps a prompt prefix cached for one organisation's requests to one model
for a few minutes after its last use (OpenAI: 5 to 10 minutes of inactivity;
Anthropic: 5 minutes, refreshed by every hit). So the cache is scoped by (API key,
model), and an entry lives ``ttl_s`` from its last write or hit; at most
``max_entries`` entries are kept (the least recently used goes first). How each API
decides what a prefix is, and how it reports it, is in :mod:`batchgen.simulator.rich`:
OpenAI caches a repeated prefix of 1024 tokens or more by itself; Anthropic only up to
a ``cache_control`` breakpoint, and only a prefix of ``min_tokens`` or more.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

MAX_ENTRIES = 10_000
Scope = tuple[str, str]  # (API key id, model)


class PromptCache:
    """Warm prefixes by (scope, prefix hash), each until ``ttl_s`` after its last use."""

    def __init__(
        self,
        ttl_s: float,
        min_tokens: int = 1024,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.min_tokens = min_tokens
        self.max_entries = max_entries
        self._clock = clock
        self._until: OrderedDict[tuple[Scope, str], float] = OrderedDict()

    def use(self, scope: Scope, prefix: str) -> bool:
        """Read the prefix from the cache (True: a hit) or write it (False: a miss); either
        way it stays warm ``ttl_s`` from now."""
        now = self._clock()
        entry = (scope, prefix)
        hit = self._until.get(entry, float("-inf")) > now
        if self.ttl_s <= 0:
            return False  # caching off: nothing is kept
        self._until[entry] = now + self.ttl_s
        self._until.move_to_end(entry)
        while len(self._until) > self.max_entries:
            self._until.popitem(last=False)
        return hit

    def clear(self) -> None:
        self._until.clear()

    def __len__(self) -> int:
        return len(self._until)
