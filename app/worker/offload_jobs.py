"""The offload tick: provider jobs created, polled, cut off, cancelled and recorded.

Run by the beat every ``BATCHGEN_OFFLOAD_INTERVAL_S`` on the control queue, one
tick at a time across every host (a PostgreSQL advisory lock held for the tick;
a dead tick's lock goes with its connection). A tick, in order:

1. **Reconciles** jobs left ``creating`` by a tick that died between recording a
   job and recording the provider's answer: found at the provider by its tag, the
   job is adopted (never created twice). Not found: an OpenAI job was never
   created (the list shows a job as soon as it exists), so its items wait for a
   new job; an Anthropic job cannot be listed until it ends, so it stays
   ``unconfirmed``, looked for at every tick, and its items go online at its cutoff.
2. **Cancels** at the provider the jobs of cancelled batches; their rows already
   answered are still recorded when the job ends, the rest end cancelled.
3. **Cuts off** jobs still running at their cutoff (deadline − the time needed to
   run them online): cancelled at the provider, their items back online at once.
4. **Polls** due jobs, with backoff; an ended job's rows are recorded through the
   same exactly-once path as an online answer, at the batch price
   (:func:`batchgen.store.ledger.record_success`, route ``offline``); rows the
   provider errored, expired or cancelled, and rows it never returned, go back
   online with the time they have left.
5. **Plans** new jobs from the offloaded items waiting, per model and batch,
   within the provider's bounds (requests, bytes, and its enqueued-token limit,
   counted over the model's open jobs under the tick's lock), each recorded with its
   items *before* the call that creates it.

An item answered by both routes keeps one result; the other answer is ledgered as
waste (nothing is paid twice unseen).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from batchgen.config import Settings
from batchgen.domain.formats.endpoints import line_endpoint
from batchgen.domain.lifecycle.status import JobStatus
from batchgen.domain.scheduling.offload import (
    JobBounds,
    OfflineWindow,
    OffloadMode,
    Route,
    Row,
    cutoff_at,
    keeps_offline,
    online_time_s,
    plan_jobs,
    poll_delay_s,
    too_few,
)
from batchgen.providers import offline
from batchgen.providers.offline import JobStatus as ProviderState
from batchgen.providers.offline import OfflineJobs, OfflineRow, RowKind, RowResult
from batchgen.registry import ModelSpec, Registry
from batchgen.store import batches, items, provider_jobs
from batchgen.store.db import ADVISORY_NAMESPACE, session_lock, session_scope
from batchgen.store.ledger import CallOutcome, record_success
from batchgen.store.provider_jobs import JobRecord
from batchgen.worker import money_holds, money_settle

log = logging.getLogger(__name__)
money_settle.install()  # each ledger write settles its call's dollar reservation

TICK_LOCK = (ADVISORY_NAMESPACE + 3, 0)
RECORD_CHUNK = 200  # rows recorded per transaction
# What a request's line adds to its body in the job's input file (custom_id, url...).
LINE_OVERHEAD_BYTES = 120
Adapters = Callable[[ModelSpec], OfflineJobs]

# Codes an item carries back online (never the provider's text).
LATE, FAILED, MISSING, WINDOW, TOO_LARGE, OFF, TOO_FEW = (
    "offline_late",
    "offline_job_failed",
    "offline_no_row",
    "offline_window_passed",
    "offline_too_large",
    "offload_turned_off",
    "offline_too_few",
)


@dataclass
class TickReport:
    held: bool = True
    created: int = 0
    adopted: int = 0
    polled: int = 0
    ended: int = 0
    cancelled: int = 0
    cut_off: int = 0
    recorded: int = 0
    returned: int = 0
    batches: set[str] = field(default_factory=set)


def single_flight() -> contextlib.AbstractContextManager[bool]:
    """The tick's lock across hosts: True when this process holds it. A session lock,
    so on a direct connection (a transaction pooler would unlock another session)."""
    return session_lock(TICK_LOCK)


def tick(
    registry: Registry, settings: Settings, adapters: Adapters = offline.jobs_for
) -> TickReport:
    """One offload tick (see the module's doc); does nothing when another tick runs."""
    with single_flight() as held:
        report = TickReport(held=held)
        if not held:
            return report
        # Jobs are followed for every model (one may have stopped offloading since);
        # new ones are planned only for the models that offload now.
        specs = {s.name: s for s in registry}
        with session_scope() as session:
            creating = provider_jobs.unsettled(session)
        for job in creating:
            _reconcile(job, specs, adapters, report)
        with session_scope() as session:
            to_cancel = provider_jobs.cancel_wanted(session)
        for job in to_cancel:
            _cancel(job, specs, adapters, "batch_cancelled", report)
        with session_scope() as session:
            to_cut = provider_jobs.late(session)
        for job in to_cut:
            _cancel(job, specs, adapters, "cutoff", report)
        with session_scope() as session:
            due = provider_jobs.due(session)
            waiting_models = items.offload_waiting_models(session)
        for job in due:
            _poll(job, specs, adapters, settings, report)
        for model in sorted(waiting_models):
            spec = specs.get(model)
            if spec is not None and spec.offline_route is not None:
                _plan(spec, adapters(spec), settings, report)
            else:
                _turned_off(model, settings, report)
        for batch_id in report.batches:
            with session_scope() as session:
                batches.finish_if_done(session, batch_id)
        return report


def _turned_off(model: str, settings: Settings, report: TickReport) -> None:
    """Items waiting for a job of a model that no longer offloads run online."""
    with session_scope() as session:
        ids = [
            w.item_id for w in items.offload_waiting(session, model, settings.offload.plan_limit)
        ]
        returned = items.return_online(session, OFF, "its model no longer offloads", item_ids=ids)
    report.returned += len(returned)
    report.batches.update(batch_id for _, batch_id, _ in returned)


# --- provider errors -------------------------------------------------------------


def _status_of(exc: Exception) -> int | None:
    return offline.status_of(exc)


def _refused(exc: Exception) -> bool:
    """The provider answered and said no (a 4xx other than 408/409/429): retrying the
    same request will not help."""
    status = _status_of(exc)
    return status is not None and 400 <= status < 500 and status not in (408, 409, 429)


def _provider_error(exc: Exception) -> bool:
    return offline.is_provider_error(exc)


# --- 1. reconcile -----------------------------------------------------------------


def _reconcile(
    job: JobRecord, specs: dict[str, ModelSpec], adapters: Adapters, report: TickReport
) -> None:
    spec = specs.get(job.model)
    if spec is None:
        return
    adapter = adapters(spec)
    try:
        found = adapter.find(spec, job.tag)
    except Exception as exc:
        if not _provider_error(exc):
            raise
        log.warning(
            "offload: job %d: cannot look for it at the provider (%s)", job.id, type(exc).__name__
        )
        return
    with session_scope() as session:
        if found is not None:
            provider_jobs.mark_created(session, job.id, found, 0.0)
            report.adopted += 1
            log.info("offload: job %d found at the provider as %s; adopted", job.id, found)
            if job.cancel_sent_at is not None:  # cancelled or cut off while unconfirmed
                try:
                    adapter.cancel(spec, found)
                except Exception as exc:
                    if not _provider_error(exc):
                        raise
        elif job.status is JobStatus.CREATING and adapter.lists_running:
            provider_jobs.mark(session, job.id, JobStatus.ABANDONED, "create_lost")
            items.unassign_job(session, job.id)
            log.info(
                "offload: job %d never reached the provider; its items wait for a new job", job.id
            )
        elif job.status is JobStatus.CREATING:
            provider_jobs.mark(session, job.id, JobStatus.UNCONFIRMED, "create_answer_lost")
            log.warning(
                "offload: job %d: the create answer was lost and the provider lists jobs only "
                "once they end; its items go online at its cutoff unless it turns up",
                job.id,
            )


# --- 2, 3. cancel -----------------------------------------------------------------


def _cancel(
    job: JobRecord,
    specs: dict[str, ModelSpec],
    adapters: Adapters,
    reason: str,
    report: TickReport,
) -> None:
    spec = specs.get(job.model)
    if job.provider_job_id is not None and spec is not None:
        try:
            adapters(spec).cancel(spec, job.provider_job_id)
        except Exception as exc:
            if not _provider_error(exc):
                raise
            if not _refused(exc):  # unreachable: try again at the next tick
                log.warning("offload: job %d: cancel failed (%s)", job.id, type(exc).__name__)
                return
    with session_scope() as session:
        provider_jobs.mark_cancel_sent(session, job.id, reason)
        if reason == "cutoff":
            returned = items.return_online(
                session, LATE, "the provider's job ran past its cutoff", job_id=job.id
            )
            report.cut_off += 1
            report.returned += len(returned)
            log.info("offload: job %d past its cutoff: %d items back online", job.id, len(returned))
        else:
            report.cancelled += 1
        if job.provider_job_id is None:  # nothing to wait for at the provider
            returned = items.return_online(session, "cancelled", "batch cancelled", job_id=job.id)
            report.returned += len(returned)
    report.batches.add(job.batch_id)


# --- 4. poll and record ------------------------------------------------------------


def _poll(
    job: JobRecord,
    specs: dict[str, ModelSpec],
    adapters: Adapters,
    settings: Settings,
    report: TickReport,
) -> None:
    spec = specs.get(job.model)
    if spec is None or job.provider_job_id is None:
        return
    adapter = adapters(spec)
    report.polled += 1
    try:
        state = adapter.state(spec, job.provider_job_id)
    except Exception as exc:
        if not _provider_error(exc):
            raise
        log.warning("offload: job %d: poll failed (%s)", job.id, type(exc).__name__)
        state = None
    if state is None or state.status is ProviderState.RUNNING:
        with session_scope() as session:
            delay = poll_delay_s(
                job.polls, settings.offload.poll_first_s, settings.offload.poll_max_s
            )
            provider_jobs.schedule_poll(session, job.id, delay)
        return
    if state.status is ProviderState.FAILED:
        with session_scope() as session:
            provider_jobs.mark(session, job.id, JobStatus.FAILED, state.reason)
            if state.reason == "token_limit_exceeded" and job.cancel_sent_at is None:
                items.unassign_job(session, job.id)  # the provider had no room yet: wait
            else:
                returned = items.return_online(
                    session, FAILED, f"the provider's job failed: {state.reason}", job_id=job.id
                )
                report.returned += len(returned)
        report.batches.add(job.batch_id)
        return
    try:
        _collect(job, spec, adapter, report)
    except Exception as exc:
        if not _provider_error(exc):
            raise
        log.warning(
            "offload: job %d: reading its rows failed (%s); later", job.id, type(exc).__name__
        )


def _outcome(row: RowResult, attempt: int) -> CallOutcome:
    response = row.response
    assert response is not None
    return CallOutcome(
        item_id=row.item_id,
        attempt=attempt,
        prompt_tokens=response.prompt_tokens,
        completion_tokens=response.completion_tokens,
        response=response.body,
        provider_request_id=response.request_id,
    )


def _collect(job: JobRecord, spec: ModelSpec, adapter: OfflineJobs, report: TickReport) -> None:
    """Record every row of an ended job, then send what it did not answer online."""
    assert job.provider_job_id is not None
    with session_scope() as session:
        attempts = provider_jobs.attempts_of(session, job.id)
    rows = adapter.results(spec, job.provider_job_id, job.tag)
    recorded = 0
    while chunk := list(islice(rows, RECORD_CHUNK)):
        with session_scope() as session:
            unanswered: list[int] = []
            codes: dict[str, list[int]] = {}
            for row in chunk:
                attempt = attempts.get(row.item_id)
                if attempt is None:
                    continue  # not one of this job's items
                if row.kind is RowKind.SUCCEEDED:
                    if record_success(session, _outcome(row, attempt), spec, Route.OFFLINE):
                        recorded += 1
                else:
                    codes.setdefault(row.error_code or row.kind.value, []).append(row.item_id)
                    unanswered.append(row.item_id)
            for code, ids in codes.items():
                returned = items.return_online(
                    session, code, f"the provider's job: {code}", job_id=job.id, item_ids=ids
                )
                report.returned += len(returned)
    with session_scope() as session:
        returned = items.return_online(
            session, MISSING, "the provider's job returned no row for it", job_id=job.id
        )
        report.returned += len(returned)
        provider_jobs.mark(session, job.id, JobStatus.ENDED)
    report.ended += 1
    report.recorded += recorded
    report.batches.add(job.batch_id)
    log.info("offload: job %d ended: %d results recorded", job.id, recorded)


# --- 5. plan and create -------------------------------------------------------------


def _size_bytes(body: dict[str, object]) -> int:
    return len(json.dumps(body, ensure_ascii=False).encode()) + LINE_OVERHEAD_BYTES


def _plan(spec: ModelSpec, adapter: OfflineJobs, settings: Settings, report: TickReport) -> None:
    route = spec.offline_route
    assert route is not None
    window = OfflineWindow(route.turnaround_s, route.fallback_s)
    with session_scope() as session:
        waiting = items.offload_waiting(session, spec.name, settings.offload.plan_limit)
        used = provider_jobs.enqueued_tokens(session, spec.name)
        now = provider_jobs.now(session)
    free = None if route.enqueued_tokens is None else route.enqueued_tokens - used
    by_batch: dict[str, list[items.Waiting]] = {}
    for w in waiting:
        by_batch.setdefault(w.batch_id, []).append(w)
    for batch_id, group in by_batch.items():
        rows = [
            Row(w.item_id, w.prompt_tokens_est + w.max_tokens, _size_bytes(w.body)) for w in group
        ]
        online_s = online_time_s(sum(r.tokens for r in rows), spec.tokens_per_min, route.fallback_s)
        deadline = min(w.deadline_at for w in group)
        left_s = (deadline - now).total_seconds()
        mode = OffloadMode(group[0].offload)
        too_large = [r.item_id for r in rows if r.size_bytes > route.max_bytes]
        if not keeps_offline(mode=mode, window=window, deadline_left_s=left_s, online_s=online_s):
            with session_scope() as session:
                returned = items.return_online(
                    session,
                    WINDOW,
                    "its deadline no longer leaves time for a provider job",
                    item_ids=[w.item_id for w in group],
                )
            report.returned += len(returned)
            report.batches.add(batch_id)
            continue
        if too_large:
            with session_scope() as session:
                items.return_online(
                    session, TOO_LARGE, "larger than a provider job", item_ids=too_large
                )
            report.returned += len(too_large)
        bounds = JobBounds(route.max_requests, route.max_bytes, free)
        planned = plan_jobs(rows, bounds)
        fits = len(rows) - len(too_large)
        planned, small = too_few(planned, spec.min_job_requests, sum(map(len, planned)) == fits)
        if small:
            with session_scope() as session:
                returned = items.return_online(
                    session,
                    TOO_FEW,
                    "fewer than the provider's requests per job",
                    item_ids=[r.item_id for r in small],
                )
            report.returned += len(returned)
            report.batches.add(batch_id)
        for job_rows in planned:
            tokens = _create(
                spec, adapter, batch_id, job_rows, cutoff_at(deadline, online_s), group, settings
            )
            if tokens is None:
                return  # the provider is unreachable or full: the next tick tries again
            report.created += bool(tokens)
            if free is not None:
                free -= tokens
        if free is not None and free <= 0:
            return


def _reserved(
    spec: ModelSpec,
    batch_id: str,
    job: JobRecord,
    attempts: dict[int, int],
    by_id: dict[int, items.Waiting],
) -> bool:
    """The job's rows reserved in their dollar budgets (batchgen.worker.money_holds); refused,
    the job is not created: it ends failed and its items go back online, where the
    dispatcher holds them as any item its budget cannot cover (failed
    ``budget_exhausted`` if still held at their deadline)."""
    rows = [
        (item_id, attempt, by_id[item_id].prompt_tokens_est, by_id[item_id].max_tokens)
        for item_id, attempt in sorted(attempts.items())
    ]
    with session_scope() as session:
        if money_holds.reserve_job(session, batch_id, spec.name, rows):
            return True
        provider_jobs.mark(session, job.id, JobStatus.FAILED, items.BUDGET_HELD)
        why = "its dollar budget cannot cover a provider job"
        items.return_online(session, items.BUDGET_HELD, why, job_id=job.id)
    log.info("offload: job %d not created: its budget cannot cover it", job.id)
    return False


def _create(
    spec: ModelSpec,
    adapter: OfflineJobs,
    batch_id: str,
    rows: list[Row],
    cutoff: dt.datetime,
    group: list[items.Waiting],
    settings: Settings,
) -> int | None:
    """Record a job and create it at the provider; returns its enqueued tokens, or None
    when the provider could not take it now (the tick stops planning the model)."""
    with session_scope() as session:
        recorded = provider_jobs.record_job(
            session, model=spec.name, batch_id=batch_id, rows=rows, cutoff_at=cutoff
        )
    if recorded is None:
        return 0
    job, attempts = recorded
    by_id = {w.item_id: w for w in group}
    if not _reserved(spec, batch_id, job, attempts, by_id):
        return 0
    requests = [
        OfflineRow(
            item_id,
            by_id[item_id].body,
            by_id[item_id].max_tokens,
            line_endpoint(by_id[item_id].endpoint),
            cache_prefix=by_id[item_id].prefix_key is not None,
        )
        for item_id in sorted(attempts)
    ]
    try:
        provider_id = adapter.create(spec, requests, job.tag)
    except Exception as exc:
        if not _provider_error(exc):
            raise
        status = _status_of(exc)
        with session_scope() as session:
            if status == 429:  # the provider's queue is full: the items wait
                provider_jobs.mark(session, job.id, JobStatus.FAILED, "rate_limited")
                items.unassign_job(session, job.id)
            elif _refused(exc):
                provider_jobs.mark(session, job.id, JobStatus.FAILED, f"http_{status}")
                items.return_online(
                    session, FAILED, f"the provider refused the job: HTTP {status}", job_id=job.id
                )
            # else: unknown whether it was created; the next tick reconciles by its tag
        log.warning("offload: job %d: create failed (%s)", job.id, type(exc).__name__)
        return None
    with session_scope() as session:
        provider_jobs.mark_created(session, job.id, provider_id, settings.offload.poll_first_s)
    log.info(
        "offload: job %d created at the provider as %s (%d items)",
        job.id,
        provider_id,
        len(requests),
    )
    return job.enqueued_tokens
