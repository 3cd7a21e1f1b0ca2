"""A nightly run: submit a job's batches for a day (once), then collect and report."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from decimal import Decimal
from itertools import chain
from typing import Any

from batchgen import python_api
from batchgen.config import Settings, get_settings
from batchgen.domain.lifecycle.status import Priority
from batchgen.errors import NotFound, ValidationFailed
from batchgen.nightly import reuse
from batchgen.nightly.catalog import PromptRenderer, Reject, parts, requests
from batchgen.nightly.jobs import Job, TableRef
from batchgen.nightly.output import description, write_file, write_table, write_text
from batchgen.store import batches, usage
from batchgen.store.db import session_scope

log = logging.getLogger(__name__)


def run_batch_ids(job: Job, day: dt.date) -> list[str]:
    """The ids of the batches of ``job`` for ``day``, in part order."""
    with session_scope() as session:
        rows = batches.keyed_batches(session, job.tenant, job.key_prefix(day))
    return [batch_id for batch_id, key in sorted(rows, key=lambda r: int(r[1].rsplit(":")[-1]))]


def submit_job(job: Job, day: dt.date, settings: Settings | None = None) -> tuple[list[str], bool]:
    """Submit the job's batches for ``day`` unless they exist; returns ``(ids, created)``.

    A catalog row that cannot make a prompt (a value the template uses is
    missing or empty, a malformed line) is not submitted: it goes to the run's
    rejects file (:meth:`Job.rejects_path`) with its source line, and the other
    rows run. A catalog larger than ``BATCHGEN_MAX_BATCH_LINES`` (or than a
    submit's bytes) goes in several parts, each a batch with its own idempotency
    key. An incremental job submits only the products whose request changed since
    their last description (:mod:`batchgen.nightly.reuse`); when none did, the run
    has no batch.
    """
    settings = settings or get_settings()
    before = set(run_batch_ids(job, day))
    renderer = PromptRenderer(job)
    rejects: list[Reject] = []
    lines_to_submit = requests(job, renderer, rejects)
    reused: dict[str, str] = {}
    recorded = False
    if job.incremental:
        planned = reuse.plan(job, lines_to_submit)
        if planned:
            reused, recorded = reuse.record(job, day, planned, rejects)
        lines_to_submit = reuse.to_describe(job, renderer, planned, reused)
    ids: list[str] = []
    # Each part within a submit's bounds: its lines, its bytes and the text the
    # tokenizer may be handed (a repeated system prompt counts on every line).
    max_bytes = min(settings.submit.max_body_bytes, settings.submit.max_tokenize_bytes)
    for part, lines in enumerate(
        parts(lines_to_submit, settings.submit.max_batch_lines, max_bytes)
    ):
        batch = python_api.submit_batch(
            lines,
            tenant=job.tenant,
            completion_window=job.completion_window,
            metadata={"nightly_job": job.name, "run_date": day.isoformat(), "part": part},
            idempotency_key=f"{job.key_prefix(day)}{part}",
            priority=Priority.BULK,
            offload=job.offload,
            route=job.route,
        )
        ids.append(batch["id"])
    rejects_file = job.rejects_path(day)
    write_file(rejects_file, (r.as_dict() for r in rejects))  # empty: none rejected
    if rejects:
        log.warning(
            "nightly job=%s date=%s rejected=%d rows, see %s",
            job.name,
            day,
            len(rejects),
            rejects_file,
        )
    if not ids and not reused:
        raise ValidationFailed(
            f"nightly job {job.name}: no product to describe; "
            f"{len(rejects)} rows rejected, see {rejects_file}"
            if rejects
            else f"nightly job {job.name}: the catalog is empty"
        )
    created = recorded or not set(ids) <= before
    log.info(
        "nightly job=%s date=%s batches=%s reused=%d created=%s",
        job.name,
        day,
        ids,
        len(reused),
        created,
    )
    return ids, created


def _rejected(job: Job, day: dt.date) -> int:
    """How many catalog rows the run's submission left out (its rejects file's lines)."""
    try:
        with open(job.rejects_path(day), encoding="utf-8") as fh:
            return sum(1 for line in fh if line.strip())
    except FileNotFoundError:
        return 0


@dataclass(frozen=True)
class RunReport:
    """What a finished run produced; ``line()`` is the one-line report.

    ``products``: the run's products, described or ``reused`` (served their stored
    text); ``succeeded`` ... ``cancelled`` count the described ones; tokens and cost
    are those of the calls made.
    """

    job: str
    date: str
    batches: list[str]
    products: int
    written: int
    succeeded: int
    failed: int
    expired: int
    cancelled: int
    rejected: int
    reused: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal

    def line(self) -> str:
        return (
            f"nightly job={self.job} date={self.date} products={self.products} "
            f"written={self.written} succeeded={self.succeeded} failed={self.failed} "
            f"expired={self.expired} cancelled={self.cancelled} rejected={self.rejected} "
            f"reused={self.reused} "
            f"prompt_tokens={self.prompt_tokens} completion_tokens={self.completion_tokens} "
            f"cost_usd={self.cost_usd:.6f} batches={','.join(self.batches)}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cost_usd": str(self.cost_usd), "line": self.line()}


def _descriptions(job: Job, batch_ids: list[str]) -> Iterator[dict[str, Any]]:
    for batch_id in batch_ids:
        for row in python_api.iter_results(batch_id, tenant=job.tenant):
            text = description(row)
            if text is not None:
                yield {"id": row["custom_id"], "locale": job.locale, "description": text}


def _usage(batch_ids: list[str]) -> tuple[int, int, Decimal]:
    """Tokens and cost of every billed call of the batches (wasted ones included)."""
    with session_scope() as session:
        return usage.of_batches(session, batch_ids)


def collect_job(job: Job, day: dt.date) -> RunReport | None:
    """Once every batch of the run has ended: write the output and report; else ``None``.

    An incremental run's output is its descriptions, which are stored for the next
    runs, then its reused products' texts."""
    batch_ids = run_batch_ids(job, day)
    reused = reuse.recorded(job, day)
    if not batch_ids and reused is None:
        raise NotFound(f"nightly job {job.name}: no batches for {day.isoformat()}")
    infos = [python_api.get_batch(b, tenant=job.tenant) for b in batch_ids]
    if any(info["finished_at"] is None for info in infos):
        return None
    rows = _descriptions(job, batch_ids)
    if reused is not None:
        rows = chain(reuse.storing(job, day, rows), reuse.reused_rows(job, day))
    if isinstance(job.output, TableRef):
        written = write_table(job.output, job, day, rows)
    else:
        written = write_file(job.path(job.output, day), rows)
    if reused is not None:
        reuse.close(job, day)
    counts = {
        k: sum(i["request_counts"][k] for i in infos)
        for k in ("total", "succeeded", "failed", "expired", "cancelled")
    }
    prompt_tokens, completion_tokens, cost_usd = _usage(batch_ids)
    report = RunReport(
        job=job.name,
        date=day.isoformat(),
        batches=batch_ids,
        products=counts["total"] + (reused or 0),
        written=written,
        succeeded=counts["succeeded"],
        failed=counts["failed"],
        expired=counts["expired"],
        cancelled=counts["cancelled"],
        rejected=_rejected(job, day),
        reused=reused or 0,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cost_usd=cost_usd,
    )
    if job.report is not None:
        write_text(job.path(job.report, day), report.line() + "\n")
    log.info("%s", report.line())
    return report
