"""What a failed provider call becomes: a retry, a wait, or the item's end.

Each decision is :mod:`batchgen.domain.lifecycle.decisions`' (pure); this module applies it
in one transaction with the ledger row of a call that may have been billed.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain.lifecycle import retry
from batchgen.domain.lifecycle.deadlines import time_left_s
from batchgen.domain.lifecycle.decisions import (
    AfterFailure,
    AfterRateLimit,
    after_failure,
    after_rate_limit,
    attempt_cap,
)
from batchgen.domain.lifecycle.status import ItemStatus
from batchgen.domain.scheduling.pools import failover_reason
from batchgen.domain.scheduling.routes import (
    AfterRefusal,
    FlexWindow,
    ItemRoute,
    after_flex_refusal,
)
from batchgen.errors import (
    CallCancelled,
    FlexUnavailable,
    PermanentProviderError,
    ProviderError,
    RateLimited,
)
from batchgen.registry import ModelSpec, Tier
from batchgen.store import items
from batchgen.store.batches import Progress
from batchgen.store.items import Claimed, Ticket
from batchgen.store.ledger import CallOutcome, record_waste
from batchgen.worker.recording import after_commit, closing, end, with_db_retries
from batchgen.worker.verdict import Verdict

log = logging.getLogger(__name__)


def cancelled(
    item: Claimed, spec: ModelSpec, exc: CallCancelled, tier: Tier = Tier.STANDARD
) -> str:
    """The batch was cancelled mid-call: the item ends cancelled; a billed call is waste."""

    progress: list[Progress] = []

    def work(session: Session) -> None:
        message = "batch cancelled during the call"
        if items.finish(session, item, ItemStatus.CANCELLED, "cancelled", message):
            closing(session, item, progress)
        if exc.billed:
            waste = CallOutcome(
                item_id=item.item_id,
                attempt=item.attempt,
                prompt_tokens=exc.prompt_tokens or item.prompt_tokens_est,
                completion_tokens=exc.completion_tokens or 0,
                deployment=spec.served_by,
                tier=tier,
            )
            record_waste(session, waste, spec, "cancelled_mid_call")

    with_db_retries(item, "recording the cancellation", work)
    after_commit(item, progress)
    return "cancelled"


def rate_limited_call(item: Claimed, settings: Settings, exc: RateLimited) -> Verdict:
    """The provider said 429: a budget signal, not a failure. The attempt is handed
    back (the gate has put the budget key into a cooldown); the item's own 429 cap
    ends it if the limit is configured far above the provider's."""
    decision = after_rate_limit(
        retry_after_s=exc.retry_after_s,
        rate_limited=item.rate_limited + 1,
        max_rate_limited=settings.worker.max_rate_limited,
        time_left_s=time_left_s(item.deadline_at, item.db_now()),
        max_countdown_s=settings.worker.max_countdown_s,
    )
    log.info(
        "item %d attempt %d rate limited (%d so far): %s, wait %.1f s",
        item.item_id,
        item.attempt,
        item.rate_limited + 1,
        decision.action,
        decision.wait_s,
    )
    if decision.action is AfterRateLimit.FAIL:
        end(item, ItemStatus.FAILED, "rate_limited", decision.message, rate_limited=True)
        return Verdict("failed")
    if decision.action is AfterRateLimit.EXPIRE:
        end(item, ItemStatus.EXPIRED, "expired", decision.message, rate_limited=True)
        return Verdict("expired")
    reason = f"{exc.kind}: {exc.message}"

    def work(session: Session) -> Verdict:
        if decision.action is AfterRateLimit.DEFER:
            items.defer(session, item, decision.wait_s, reason, rate_limited=True)
            return Verdict("deferred")
        items.requeue(
            session, item, decision.wait_s, settings.worker.queued_lease_s, rate_limited=True
        )
        return Verdict("wait", decision.wait_s)

    return with_db_retries(item, "handing a rate-limited item back", work)


def flex_refused(
    item: Claimed, flex: FlexWindow, settings: Settings, exc: FlexUnavailable
) -> Verdict:
    """The provider refused a flex call as busy: no rate limit (no cooldown) and no
    failure (the attempt is handed back, nothing was billed). Flex again after a wait,
    or a standard call now, as :func:`batchgen.domain.scheduling.routes.after_flex_refusal`
    decides; a short wait stays queued, a long one goes back to PostgreSQL."""
    left_s = time_left_s(item.deadline_at, item.db_now())
    refusals = item.flex_refusals + 1
    decision = after_flex_refusal(
        refusals=refusals, flex=flex, retry_after_s=exc.retry_after_s, time_left_s=left_s
    )
    route, wait_s, queued = ItemRoute.STANDARD, 0.0, True
    if decision.action is AfterRefusal.RETRY_FLEX:
        plan = retry.plan_wait(
            decision.wait_s,
            left_s,
            firm=False,
            releases_dispatch=False,
            max_countdown_s=settings.worker.max_countdown_s,
        )
        if plan.action is not retry.WaitAction.EXPIRE:
            route, wait_s = ItemRoute.FLEX, plan.wait_s
            queued = plan.action is retry.WaitAction.REQUEUE
    log.info(
        "item %d attempt %d flex refused (%d so far): %s, wait %.1f s",
        item.item_id,
        item.attempt,
        refusals,
        route.value,
        wait_s,
    )

    def work(session: Session) -> bool:
        return items.reroute(
            session,
            item,
            route=route.value,
            wait_s=wait_s,
            lease_s=settings.worker.queued_lease_s if queued else None,
            code=exc.kind,
            message=decision.message,
        )

    if not with_db_retries(item, "handing a refused flex call back", work):
        return Verdict("skipped")  # cancelled or finished meanwhile
    return Verdict("wait", wait_s) if queued else Verdict("deferred")


def _unanswered(item: Claimed, spec: ModelSpec, latency_ms: int, tier: Tier) -> CallOutcome:
    """A call that failed after it was sent: the provider may charge it, its usage is
    unknown, so the ledger carries the prompt estimate (as waste), against the
    deployment that took it (``spec`` is the model as that deployment serves it)."""
    return CallOutcome(
        item_id=item.item_id,
        attempt=item.attempt,
        prompt_tokens=item.prompt_tokens_est,
        upstream_latency_ms=latency_ms,
        deployment=spec.served_by,
        tier=tier,
    )


def failover(
    item: Claimed,
    spec: ModelSpec,
    settings: Settings,
    exc: ProviderError,
    latency_ms: int,
    ticket: Ticket,
    tier: Tier = Tier.STANDARD,
) -> Verdict:
    """The call failed on its deployment (``spec``, the model as that deployment serves
    it: :meth:`ModelSpec.at`): ledger it if it may be billed, against that deployment,
    and hand the item on to another at once, with its next attempt number and that
    deployment to avoid, in one transaction; none of its failure attempts is used
    (:func:`batchgen.domain.scheduling.pools.fails_over` decided it may)."""
    reason = failover_reason(exc) or exc.kind
    deployment = spec.served_by
    message = f"{reason} on deployment {deployment}: {exc.message}"
    rate_limited = isinstance(exc, RateLimited)

    progress: list[Progress] = []

    def work(session: Session) -> str:
        if exc.billed:
            waste = _unanswered(item, spec, latency_ms, tier)
            record_waste(session, waste, spec, f"failover_{reason}")
        if items.failover(
            session,
            item,
            settings.worker.queued_lease_s,
            "failover",
            message,
            rate_limited=rate_limited,
        ):
            return "wait"
        # Not handed on: its batch was cancelled while the call ran (it must not run
        # again: it ends cancelled), or the item finished or moved on meanwhile.
        cancelled_now = items.finish(
            session, item, ItemStatus.CANCELLED, "cancelled", "batch cancelled"
        )
        if cancelled_now:
            closing(session, item, progress)
        return "cancelled" if cancelled_now else "skipped"

    outcome = with_db_retries(item, "handing the item to another deployment", work)
    after_commit(item, progress)
    log.info(
        "item %d attempt %d model %s: %s on deployment %s, failing over",
        item.item_id,
        item.attempt,
        spec.name,
        reason,
        deployment,
    )
    if outcome != "wait":  # cancelled or finished meanwhile: nothing to run again
        return Verdict(outcome)
    next_ticket = replace(ticket, attempt=item.attempt + 1, avoid=deployment)
    return Verdict("wait", 0.0, ticket=next_ticket)


def failed(
    item: Claimed,
    spec: ModelSpec,
    settings: Settings,
    exc: ProviderError,
    latency_ms: int,
    tier: Tier = Tier.STANDARD,
) -> str:
    """Ledger a billed failure as waste, then retry, fail or expire the item as
    :func:`batchgen.domain.lifecycle.decisions.after_failure` decides."""
    decision = after_failure(
        kind=exc.kind,
        message=exc.message,
        permanent=isinstance(exc, PermanentProviderError),
        attempt=item.failure_attempt,
        max_attempts=attempt_cap(spec.max_attempts, settings.worker.max_attempts),
        retry_after_s=None,
        time_left_s=time_left_s(item.deadline_at, item.db_now()),
        backoff_initial_s=settings.providers.retry_base_s,
        backoff_max_s=settings.providers.retry_max_s,
    )

    progress: list[Progress] = []

    def work(session: Session) -> str:
        if exc.billed:
            waste = _unanswered(item, spec, latency_ms, tier)
            record_waste(session, waste, spec, f"failed_{exc.kind}")
        if decision.action is AfterFailure.RETRY:
            if items.retry_later(session, item, decision.wait_s, decision.code, decision.message):
                return "retry"
            status, code, message = ItemStatus.CANCELLED, "cancelled", "batch cancelled"
        else:
            failed = decision.action is AfterFailure.FAIL
            status = ItemStatus.FAILED if failed else ItemStatus.EXPIRED
            code, message = decision.code, decision.message
        if items.finish(session, item, status, code, message):
            closing(session, item, progress)
        return status.value

    verdict = with_db_retries(item, "recording the failure", work)
    after_commit(item, progress)
    log.warning(
        "item %d attempt %d model %s %s: %s status=%s",
        item.item_id,
        item.attempt,
        spec.name,
        verdict,
        exc.kind,
        exc.status,
    )
    return verdict
