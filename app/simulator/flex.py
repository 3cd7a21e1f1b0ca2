"""OpenAI's and the Gemini API's flex tiers, simulated: slower answers, refused as busy.

A chat completions or Responses request that says ``service_tier: "flex"`` is a flex
call. It is answered ``flex_latency_factor`` times slower than a standard one, its
answer says ``"service_tier": "flex"`` (the provider bills it at the batch prices), and
it is refused with a 429 whose code is ``resource_unavailable`` (not a rate limit:
nothing is charged against the key's limits) while ``flex_max_in_flight`` flex calls
are in progress on its deployment, or, by a seeded draw, for a share
``flex_refusal_rate`` of flex calls.

A Gemini ``generateContent`` (or its stream) that says ``serviceTier: "flex"`` (read
into the chat form as ``service_tier``) is a flex call the same way, refused as
Google sheds traffic: a 503 ``UNAVAILABLE`` (:func:`refusal`).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from typing import Any

FLEX = "flex"
REFUSAL_CODE = "resource_unavailable"
REFUSAL_MESSAGE = (
    "Resource unavailable (simulated): flex processing is at capacity. Retry later, or "
    "send the request without service_tier flex."
)


GEMINI_REFUSAL_MESSAGE = (
    "The model is overloaded (simulated): flex traffic is shed. Retry later, or send the "
    "request without service tier flex."
)
FLEX_APIS = frozenset({"openai", "gemini"})


def requested(api: str, body: Any) -> bool:
    """The request asks for the flex tier (an OpenAI or Gemini request, the latter in
    the chat form it was read into)."""
    return api in FLEX_APIS and isinstance(body, Mapping) and body.get("service_tier") == FLEX


def refusal(api: str) -> tuple[int, dict[str, Any]]:
    """The status and body of a busy flex tier's refusal, as the provider words it."""
    if api == "gemini":
        error = {"code": 503, "message": GEMINI_REFUSAL_MESSAGE, "status": "UNAVAILABLE"}
        return 503, {"error": error}
    return 429, refusal_body()


def refusal_body() -> dict[str, Any]:
    """The 429's body, as OpenAI words a busy flex tier."""
    return {
        "error": {
            "message": REFUSAL_MESSAGE,
            "type": REFUSAL_CODE,
            "param": None,
            "code": REFUSAL_CODE,
        }
    }


class FlexTier:
    """Flex calls in progress per deployment (lane), and the seeded refusal draw."""

    def __init__(self, seed: int | None) -> None:
        self._rng = random.Random(seed)
        self.in_flight: Counter[str | None] = Counter()

    def refuses(self, lane: str | None, max_in_flight: int | None, refusal_rate: float) -> bool:
        """Whether the next flex call on ``lane`` is refused as busy."""
        if max_in_flight is not None and self.in_flight[lane] >= max_in_flight:
            return True
        return refusal_rate > 0 and self._rng.random() < refusal_rate

    def enter(self, lane: str | None) -> None:
        self.in_flight[lane] += 1

    def leave(self, lane: str | None) -> None:
        self.in_flight[lane] -= 1
        if self.in_flight[lane] <= 0:
            del self.in_flight[lane]
