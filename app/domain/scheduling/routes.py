"""Three routes by deadline: standard calls, flex calls, the provider's Batch API.

An item of a model runs by one of three routes, each at its own price tier:

- **standard**: an online call at the standard prices, the fastest;
- **flex** (OpenAI's ``service_tier: "flex"``, where the registry declares
  ``[models."<name>".flex]``): an online call at the batch prices, slower, and
  refused with a 429 "resource unavailable" when the provider is busy;
- **batch**: a job of the provider's own Batch API (:mod:`batchgen.domain.scheduling.offload`),
  at the batch prices, within its turnaround.

:func:`choose_route` picks one at submit from the batch's ``route`` option (``auto``,
``standard``, ``flex``, ``batch``), its priority and the time its deadline leaves:
``auto`` sends bulk work whose deadline leaves the Batch API's turnaround there, the
bulk work whose deadline leaves room for flex answers (:func:`flex_fits`) to flex,
and everything else (near deadlines, interactive work, synchronous calls) to standard
calls. At each flex call, :func:`call_route` checks the room again (a flex item that
waited too long runs standard), :func:`flex_timeout_s` cuts the call so that
``fallback_s`` is always left for a standard call, and a refusal is
:func:`after_flex_refusal`'s to settle: flex again after a wait while the deadline
allows it, else standard at once. A refusal is no rate limit (no cooldown) and no
failure (no attempt used).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from batchgen.domain.lifecycle import retry
from batchgen.domain.lifecycle.status import Priority
from batchgen.domain.scheduling.offload import OfflineWindow, OffloadMode, wants_offline
from batchgen.errors import ValidationFailed
from batchgen.registry import FLEX_KINDS, FlexRoute, ModelSpec, Tier

SERVICE_TIER = "service_tier"
FLEX_TIER = "flex"


class RouteMode(StrEnum):
    """A batch's ``route`` option."""

    AUTO = "auto"  # by deadline and priority (choose_route)
    STANDARD = "standard"  # every item a standard call
    FLEX = "flex"  # flex wherever the model offers it and the deadline allows
    BATCH = "batch"  # the provider's Batch API wherever it may (offload "always")


class ItemRoute(StrEnum):
    """The route an item's next call takes (``items.route``; ``batch`` called online:
    back from its job, see :func:`call_route`)."""

    STANDARD = "standard"
    FLEX = "flex"
    BATCH = "batch"

    @property
    def tier(self) -> Tier:
        """The price tier of a call by this route."""
        return _TIERS[self]


_TIERS = {ItemRoute.STANDARD: Tier.STANDARD, ItemRoute.FLEX: Tier.FLEX, ItemRoute.BATCH: Tier.BATCH}


def parse_route(value: str | RouteMode | None) -> RouteMode:
    """A batch's ``route`` option; :class:`ValidationFailed` naming the field otherwise."""
    if value is None:
        return RouteMode.AUTO
    try:
        return RouteMode(value)
    except ValueError:
        raise ValidationFailed(
            f"route must be one of auto, standard, flex, batch (got {value!r})", field="route"
        ) from None


# What each forced route says of the offload mode (the Batch API's own rule).
_OFFLOAD_OF = {RouteMode.STANDARD: OffloadMode.NEVER, RouteMode.FLEX: OffloadMode.NEVER}
_OFFLOAD_OF[RouteMode.BATCH] = OffloadMode.ALWAYS


def offload_of(route: RouteMode, offload: OffloadMode) -> OffloadMode:
    """The offload mode a batch keeps given its ``route``: ``batch`` is ``always``,
    ``standard`` and ``flex`` are ``never``; ``auto`` keeps the batch's own ``offload``.
    A batch that names both, at odds (``route=standard`` with ``offload=always``...), is
    refused with :class:`ValidationFailed`."""
    forced = _OFFLOAD_OF.get(route)
    if forced is None:
        return offload
    if offload not in (OffloadMode.AUTO, forced):
        raise ValidationFailed(
            f"route {route.value!r} and offload {offload.value!r} disagree: name one",
            field="route",
        )
    return forced


@dataclass(frozen=True)
class FlexWindow:
    """The numbers of a model's flex route the rules need."""

    latency_s: float  # a flex answer's typical time
    timeout_s: float  # the most one flex call may take
    fallback_s: float  # always kept back for a standard call
    retry_s: float = 5.0
    retry_max_s: float = 120.0
    max_refusals: int = 5

    @classmethod
    def of(cls, route: FlexRoute) -> FlexWindow:
        return cls(
            route.latency_s,
            route.timeout_s,
            route.fallback_s,
            route.retry_s,
            route.retry_max_s,
            route.max_refusals,
        )


# What a line that asks for flex itself (``service_tier: "flex"``) of a model whose
# registry entry declares no flex route is held to: the registry's defaults.
DEFAULT_FLEX = FlexWindow.of(FlexRoute())


@dataclass(frozen=True)
class Routes:
    """A model's routes beside standard calls (None: not offered)."""

    batch: OfflineWindow | None = None
    flex: FlexWindow | None = None
    # A line may ask for flex itself on this model (an OpenAI-format model).
    flex_on_request: bool = False


def flex_window(spec: ModelSpec, served: ModelSpec, call_timeout_s: float) -> FlexWindow | None:
    """The flex numbers of a call to ``served`` (the model as the gate's deployment
    serves it, :meth:`ModelSpec.at`): its registry's; for an OpenAI-format model that
    declares no flex route (a line that asks for flex itself), the defaults within the
    model's call timeout; None where no flex call may go (a deployment without flex, an
    Anthropic model)."""
    if served.flex is not None:
        return FlexWindow.of(served.flex)
    if spec.flex is None and spec.provider.value in FLEX_KINDS:
        return replace(DEFAULT_FLEX, timeout_s=min(DEFAULT_FLEX.timeout_s, call_timeout_s))
    return None


def flex_fits(flex: FlexWindow, time_left_s: float) -> bool:
    """The deadline leaves room for a flex answer and, after it, a standard call."""
    return time_left_s >= flex.latency_s + flex.fallback_s


def asks_flex(body: Mapping[str, Any]) -> bool:
    """The request line itself asks for OpenAI's flex tier."""
    return body.get(SERVICE_TIER) == FLEX_TIER


def choose_route(
    *,
    mode: RouteMode,
    offload: OffloadMode,
    priority: Priority,
    routes: Routes,
    deadline_left_s: float,
    asked_flex: bool = False,
) -> ItemRoute:
    """At submit: the route of one item.

    - a line that asks for flex itself (``asked_flex``) on an OpenAI-format model, in an
      ``auto`` or ``flex`` batch: flex while :func:`flex_fits` (with the model's flex
      numbers, or the defaults), else standard, whatever its priority;
    - ``standard``: standard; ``flex``: flex while it fits, else standard;
    - ``batch`` (``offload`` then ``always``) and ``auto``: the Batch API when
      :func:`batchgen.domain.scheduling.offload.wants_offline` says so (``auto``: bulk items whose
      deadline leaves its turnaround); else, for ``auto``, flex for bulk items whose
      deadline leaves room for it; else standard.

    Synchronous calls (priority ``call``) run standard unless their body asks for flex.
    """
    flex = routes.flex
    flexible = mode in (RouteMode.AUTO, RouteMode.FLEX)
    if asked_flex and flexible and (flex is not None or routes.flex_on_request):
        fits = flex_fits(flex or DEFAULT_FLEX, deadline_left_s)
        return ItemRoute.FLEX if fits else ItemRoute.STANDARD
    if priority is Priority.CALL or mode is RouteMode.STANDARD:
        return ItemRoute.STANDARD
    if mode is RouteMode.FLEX:
        fits = flex is not None and flex_fits(flex, deadline_left_s)
        return ItemRoute.FLEX if fits else ItemRoute.STANDARD
    offline = wants_offline(
        mode=offload, priority=priority, window=routes.batch, deadline_left_s=deadline_left_s
    )
    if offline:
        return ItemRoute.BATCH
    if (
        mode is RouteMode.AUTO
        and priority is Priority.BULK
        and flex is not None
        and flex_fits(flex, deadline_left_s)
    ):
        return ItemRoute.FLEX
    return ItemRoute.STANDARD


def call_route(
    route: ItemRoute,
    flex: FlexWindow | None,
    time_left_s: float,
    *,
    flex_offered: bool = False,
) -> ItemRoute:
    """At a call: a flex item calls flex while its deadline leaves room for it
    (:func:`flex_fits`) and the deployment the gate picked offers flex (``flex`` not
    None); otherwise this call is a standard one.

    An item of the Batch API's route called online is back from its job (the job
    failed, expired or ran past its cutoff, its row errored, or it never fitted one):
    where the deployment declares a flex route (``flex_offered``) and the deadline
    leaves room, it calls flex, at the batch prices still, rather than standard at
    twice them (the cheapest route that keeps its deadline, as :func:`choose_route`
    picks at submit)."""
    wants_flex = route is ItemRoute.FLEX or (route is ItemRoute.BATCH and flex_offered)
    if wants_flex and flex is not None and flex_fits(flex, time_left_s):
        return ItemRoute.FLEX
    return ItemRoute.STANDARD


def flex_timeout_s(flex: FlexWindow, time_left_s: float) -> float:
    """A flex call's timeout: its own, cut so that ``fallback_s`` is left for a
    standard call however the flex call ends."""
    return max(0.0, min(flex.timeout_s, time_left_s - flex.fallback_s))


def with_service_tier(body: dict[str, Any], route: ItemRoute) -> dict[str, Any]:
    """The request body of a call by ``route``: a flex call says ``service_tier:
    "flex"``; a standard call never does (an item that fell back from flex, or whose
    line asked for flex too close to its deadline); any other tier the line names is
    left as it is. The body is not changed in place."""
    if route is ItemRoute.FLEX:
        return body if asks_flex(body) else {**body, SERVICE_TIER: FLEX_TIER}
    if asks_flex(body):
        return {k: v for k, v in body.items() if k != SERVICE_TIER}
    return body


class AfterRefusal(StrEnum):
    RETRY_FLEX = "retry_flex"  # flex again after the wait
    STANDARD = "standard"  # a standard call now


@dataclass(frozen=True)
class RefusalDecision:
    action: AfterRefusal
    wait_s: float = 0.0
    message: str = ""


def after_flex_refusal(
    *,
    refusals: int,
    flex: FlexWindow,
    retry_after_s: float | None,
    time_left_s: float,
    rng: random.Random | None = None,
) -> RefusalDecision:
    """A flex call was refused (429 "resource unavailable"); ``refusals`` counts this
    item's refusals, this one included.

    Flex again after a wait (the provider's ``retry-after``, else backoff with full
    jitter from ``retry_s`` doubling to ``retry_max_s``) while, after that wait, the
    deadline still leaves room for a flex answer and the fallback
    (:func:`flex_fits`), and fewer than ``max_refusals`` refusals came; otherwise a
    standard call now. Neither uses a failure attempt.
    """
    if refusals >= flex.max_refusals:
        message = f"flex refused {refusals} times: a standard call"
        return RefusalDecision(AfterRefusal.STANDARD, message=message)
    wait_s = retry.backoff_s(
        refusals,
        retry_after_s=retry_after_s,
        initial_s=flex.retry_s,
        max_s=flex.retry_max_s,
        rng=rng,
    )
    if flex_fits(flex, time_left_s - wait_s):
        return RefusalDecision(AfterRefusal.RETRY_FLEX, wait_s, "flex refused: again after a wait")
    message = "flex refused and the deadline leaves no room for another: a standard call"
    return RefusalDecision(AfterRefusal.STANDARD, message=message)
