"""Reference copy of limits/lua/budget_reserve.lua's pick and budget_settle.lua's breaker.

Deployment pools, decided from plain values: which deployment takes a call, when a
failed call fails over, how long a failing deployment cools down.

A model may have several deployments (keys, orgs, regions, Azure deployments), each
with its own limits and budget (:class:`batchgen.registry.Deployment`). The gate's one
script (``lua/budget_reserve.lua``) takes a slot and the budget on the deployment that
:func:`pick` prefers among those with room: not the one the item just failed on, then
the most :func:`headroom`; the script computes both the same way, and these are their
pure twins. After a call, :func:`failover_reason` and :func:`fails_over` say whether
its failure sends the item to another deployment (no failure attempt used), and the
circuit breaker (``lua/budget_settle.lua``) cools down a deployment that keeps failing:
:func:`breaker_trips`, :func:`breaker_cooldown_s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchgen.errors import (
    MalformedResponse,
    ProviderError,
    RateLimited,
    TransientProviderError,
    Unsendable,
)

# Statuses that say the deployment (not the request) failed: the next try goes elsewhere.
TIMEOUT_STATUSES = frozenset({408})


@dataclass(frozen=True)
class Room:
    """One deployment as the gate saw it: whether it can take the call now, and what
    it would have left after it (a share of each of its limits)."""

    fits: bool
    free_tokens: float = 0.0
    tokens_limit: int = 1
    free_requests: float = 0.0
    requests_limit: int = 1
    free_slots: int = 0
    slot_limit: int = 0  # 0: slots not counted
    avoided: bool = False  # the deployment this item's last call failed on


def headroom(room: Room) -> float:
    """What a deployment has left after the call, as the smallest share of its limits
    (tokens, requests, slots): the gate spreads calls so that every deployment fills at
    the same pace, whatever its size."""
    shares = [
        room.free_tokens / max(1, room.tokens_limit),
        room.free_requests / max(1, room.requests_limit),
    ]
    if room.slot_limit > 0:
        shares.append(room.free_slots / room.slot_limit)
    return min(shares)


def pick(rooms: Sequence[Room]) -> int | None:
    """The index of the deployment to take the call, None when none fits. One the item
    did not just fail on goes first; among those, the most :func:`headroom`; on a tie,
    the one listed first (the registry's order)."""
    best: int | None = None
    best_key: tuple[bool, float] | None = None
    for index, room in enumerate(rooms):
        if not room.fits:
            continue
        key = (not room.avoided, headroom(room))
        if best_key is None or key > best_key:
            best, best_key = index, key
    return best


def failover_reason(error: ProviderError) -> str | None:
    """Why a failed call points at its deployment rather than at the request (a 429, a
    5xx, a time-out, a refused or dropped connection), or None. A malformed answer or a
    4xx other than 408/429 is the request's own failure: it fails over nowhere. A request
    the deployment's configuration could not send is the deployment's failure."""
    if isinstance(error, RateLimited):
        return "rate_limited"
    if isinstance(error, Unsendable):
        return "unsendable"
    if isinstance(error, MalformedResponse) or not isinstance(error, TransientProviderError):
        return None
    if error.status is None or error.status in TIMEOUT_STATUSES:
        return "timeout" if error.message.startswith("timeout") else "connection"
    if error.status == 200:  # a stream cut or past its deadline: the answer had started
        return "timeout" if error.message.startswith("timeout") else "connection"
    return "server_error" if error.status >= 500 else None


def fails_over(
    *, deployments: int, reason: str | None, failovers: int, max_failovers: int, time_left_s: float
) -> bool:
    """Whether a failed call's next try goes to another deployment at once, using none
    of the item's failure attempts: the model has more than one deployment, the failure
    was the deployment's (:func:`failover_reason`), the item has failed over fewer than
    ``max_failovers`` times and its deadline leaves time. Otherwise the failure is
    handled as on a model of one deployment (a 429 waits, others use an attempt)."""
    return deployments > 1 and reason is not None and failovers < max_failovers and time_left_s > 0


def breaker_trips(failures_in_window: int, threshold: int, tripped_before: bool) -> bool:
    """Whether a deployment's failure opens its breaker: ``threshold`` failures within
    the window, or a single one after a cooldown that no success has followed yet (the
    probe failed)."""
    return tripped_before or failures_in_window >= threshold


def breaker_cooldown_s(trips: int, base_s: float, max_s: float) -> float:
    """How long a deployment cools down at its ``trips``-th trip in a row (1 for the
    first): ``base_s``, doubled each trip, at most ``max_s``."""
    return min(max_s, base_s * 2 ** max(0, trips - 1))


def breaker_signal(
    *,
    deployments: int,
    answered: bool,
    error: ProviderError | None,
    cut_by_deadline: bool = False,
) -> str:
    """What a call's end tells its deployment's circuit breaker: ``"ok"`` (an answer),
    ``"fail"`` (a failure that points at the deployment, a 429 aside: its retry-after
    already cools the deployment down) or ``""`` (nothing: a model of one deployment
    keeps no breaker, and a cancelled or refused request says nothing of the
    deployment; nor does a time-out of a call ``cut_by_deadline``, whose time-out was
    its item's time left, shorter than the model's own: the item ran out of time)."""
    if deployments <= 1:
        return ""
    if answered:
        return "ok"
    if error is None or isinstance(error, RateLimited):
        return ""
    reason = failover_reason(error)
    if reason is None or (cut_by_deadline and reason == "timeout"):
        return ""
    return "fail"
