"""Incremental runs: a product whose request has not changed since its last description
is served that text instead of being called again (``incremental = true``, the default).

Submitting reads the catalog twice: once to hash every product's request and record,
once per run, which products are reused (:func:`record`), then again to submit the
others (:func:`to_describe`), each checked against the hash recorded for it. Collecting
stores the run's results as the products' descriptions (:func:`storing`) and adds the
reused texts to the output (:func:`reused_rows`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator
from typing import Any

from batchgen.errors import Conflict, IdempotencyKeyReused, ValidationFailed
from batchgen.nightly.catalog import PromptRenderer, Reject, chunks, requests
from batchgen.nightly.jobs import Job
from batchgen.nightly.reruns import changed_since, request_sha256
from batchgen.store import nightly
from batchgen.store.db import session_scope

STORE_ROWS = 1000


def plan(job: Job, lines: Iterable[dict[str, Any]]) -> dict[str, str]:
    """Each product's request hash, in catalog order (a product key twice: refused)."""
    planned: dict[str, str] = {}
    for line in lines:
        product_id = line["custom_id"]
        if product_id in planned:
            raise ValidationFailed(
                f"nightly job {job.name}: product {product_id!r} is in the catalog twice"
            )
        planned[product_id] = request_sha256(line)
    return planned


def record(
    job: Job, day: dt.date, planned: dict[str, str], rejects: list[Reject]
) -> tuple[dict[str, str], bool]:
    """The run's reused products (product -> request hash), chosen once per job and day;
    ``created``: this call chose them (False: a second submit, which replays them)."""
    known = [*planned, *(r.id for r in rejects if r.id is not None)]
    with session_scope() as session:
        key = nightly.RunKey.find(session, job.tenant, job.name, day)
        reused, created = nightly.record_run(session, key, list(planned.items()), known)
        changed = changed_since(reused, planned)
        if changed is not None:  # rolls the marks back
            raise IdempotencyKeyReused(
                f"nightly job {job.name}: the run of {day.isoformat()} was submitted with "
                f"another catalog (product {changed!r} changed since)"
            )
    return reused, created


def to_describe(
    job: Job, renderer: PromptRenderer, planned: dict[str, str], reused: dict[str, str]
) -> Iterator[dict[str, Any]]:
    """The catalog's requests again, but the reused ones; each must be the one planned."""
    if len(reused) == len(planned):
        return  # all reused: no second reading
    seen = 0
    for line in requests(job, renderer, []):
        if planned.get(line["custom_id"]) != request_sha256(line):
            raise _changed(job)
        seen += 1
        if line["custom_id"] not in reused:
            yield line
    if seen != len(planned):
        raise _changed(job)


def _changed(job: Job) -> Conflict:
    return Conflict(f"nightly job {job.name}: the catalog changed while it was read; run again")


def _key(job: Job, day: dt.date) -> nightly.RunKey:
    with session_scope() as session:
        return nightly.RunKey.find(session, job.tenant, job.name, day)


def recorded(job: Job, day: dt.date) -> int | None:
    """How many products the run reused; ``None``: the run was not recorded (the job is
    not incremental, or has not been submitted for the day)."""
    with session_scope() as session:
        key = nightly.RunKey.find(session, job.tenant, job.name, day)
        return nightly.recorded_reuse(session, key)


def storing(job: Job, day: dt.date, rows: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """``rows`` (the run's output rows) passed on, each stored as its product's
    description on the way, unless a later run has submitted the product since."""
    key = _key(job, day)
    for chunk in chunks(rows, STORE_ROWS):
        with session_scope() as session:
            nightly.store_descriptions(session, key, [(r["id"], r["description"]) for r in chunk])
        yield from chunk


def reused_rows(job: Job, day: dt.date) -> Iterator[dict[str, Any]]:
    """The output rows of the run's reused products, in catalog order."""
    key = _key(job, day)
    with session_scope() as session:
        for product_id, text in nightly.reused_descriptions(session, key):
            yield {"id": product_id, "locale": job.locale, "description": text}


def close(job: Job, day: dt.date) -> None:
    """The run's output is written: the job's earlier runs' reused texts are dropped
    (this run's are kept until a later run's output is written)."""
    key = _key(job, day)
    with session_scope() as session:
        nightly.close_run(session, key)
