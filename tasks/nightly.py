"""The nightly description jobs: beat starts a run; a collect task writes its output.

Messages carry a job name and a date only. Submitting is idempotent per job
and date, so a beat that fires twice (or a run started by hand as well)
stores one set of batches; collecting rewrites the same output.
"""

from __future__ import annotations

import datetime as dt
import logging

from celery import Task

from batchgen.config import get_settings
from batchgen.errors import BatchgenError
from batchgen.nightly import collect_job, jobs_from_settings, select_jobs, submit_job
from batchgen.tasks.celery_app import celery_app
from batchgen.worker import publish
from batchgen.worker.names import COLLECT_TASK, NIGHTLY_TASK

log = logging.getLogger(__name__)


def _day(day: str | None) -> dt.date:
    return dt.date.fromisoformat(day) if day else dt.datetime.now(dt.UTC).date()


def start_run(day: dt.date, job_name: str | None = None) -> dict[str, list[str]]:
    """Submit the jobs' batches for ``day`` and schedule their collection.

    Returns the batch ids per job. A job that fails to submit is logged and
    skipped; the others still run. Collection is scheduled by every firing
    (writing the output is idempotent), so a run whose first collect message
    was lost still ends with its output written.
    """
    jobs = select_jobs(jobs_from_settings(), job_name)
    started: dict[str, list[str]] = {}
    for job in jobs:
        try:
            ids, _ = submit_job(job, day)
        except BatchgenError as exc:
            log.error("nightly job=%s date=%s not submitted: %s", job.name, day, exc)
            continue
        started[job.name] = ids
        publish.collect_later(job.name, day.isoformat(), get_settings().nightly.poll_s)
    return started


@celery_app.task(name=NIGHTLY_TASK, ignore_result=True)
def nightly(day: str | None = None) -> dict[str, list[str]]:
    """Beat's entry: run every job of ``BATCHGEN_NIGHTLY_JOBS_FILE`` for ``day`` (UTC today)."""
    if get_settings().nightly.jobs_file is None:
        log.warning("nightly: BATCHGEN_NIGHTLY_JOBS_FILE is unset; nothing to do")
        return {}
    return start_run(_day(day))


# max_retries=None: waiting for a batch to end is not a failure; the batch's
# own completion window bounds the wait.
@celery_app.task(name=COLLECT_TASK, bind=True, ignore_result=True, max_retries=None)
def collect(self: Task, job_name: str, day: str) -> str | None:
    """Write the run's output and report once its batches have ended; else check again later.

    The job is looked up by name in this worker's ``BATCHGEN_NIGHTLY_JOBS_FILE``:
    no path (jobs file, output, report) ever comes from a message, and a message
    with more arguments than these two fails without running.
    """
    (job,) = select_jobs(jobs_from_settings(), job_name)
    report = collect_job(job, _day(day))
    if report is None:
        raise self.retry(countdown=get_settings().nightly.poll_s)
    return report.line()
