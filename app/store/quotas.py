"""Admission bounds read at submit, inside the submit transaction.

The store takes the locks and reads the counts; the verdicts are
:mod:`batchgen.domain.submission`'s:

* Per model: the backlog (estimated tokens of open items) may not exceed a
  bound, by default ``max_backlog_min`` minutes of the model's tokens/min.
  Over it → :class:`Overloaded` (503) with ``Retry-After`` = the time the
  model needs to work off the excess at its tokens/min.
* Per tenant: open items (``max_pending_items``) and tokens per UTC day
  (``daily_token_quota``, used + still open) → :class:`OverQuota` (429).
* Per tenant, at upload: its files not yet deleted or expired, by count and bytes
  (``max_files`` / ``max_file_bytes``, else the settings' ``tenant_max_files`` /
  ``tenant_max_file_bytes``) → :class:`FileQuotaExceeded` (429), or 413 for a file
  that alone is over the bytes.

A rejection raises, the transaction rolls back, and nothing is stored.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain import submission as verdicts
from batchgen.domain.lifecycle.status import OPEN, ItemStatus, values
from batchgen.registry import Registry
from batchgen.store import totals
from batchgen.store.db import ADVISORY_NAMESPACE
from batchgen.store.schema import File, Tenant, TenantDailyUsage

# A model's online backlog: what its workers still have to run (offloaded items wait
# for the provider's Batch API, on a quota of their own).
ONLINE_OPEN_VALUES = values(OPEN - {ItemStatus.OFFLOADED})


def check_files(session: Session, tenant: Tenant, new_bytes: int, settings: Settings) -> None:
    """Raise unless a new upload of ``new_bytes`` fits the tenant's file quota; its
    uploads are counted one after another (the lock holds to the end of the
    transaction that stores the file)."""
    session.execute(
        text("SELECT pg_advisory_xact_lock(:ns, :tenant)"),
        {"ns": ADVISORY_NAMESPACE + 4, "tenant": tenant.id},
    )
    alive = (File.expires_at.is_(None)) | (File.expires_at > func.now())
    files, used, first_expiry_s = session.execute(
        select(
            func.count(),
            func.coalesce(func.sum(File.size_bytes), 0),
            func.extract("epoch", func.min(File.expires_at) - func.now()),
        ).where(File.tenant_id == tenant.id, alive)
    ).one()
    verdicts.check_file_quota(
        tenant.name,
        new_bytes,
        (int(files), int(used)),
        verdicts.file_quota(tenant.max_files, tenant.max_file_bytes, settings),
        None if first_expiry_s is None else float(first_expiry_s),
    )


def _open(
    session: Session, registry: Registry, model: str | None = None, tenant_id: int | None = None
) -> totals.Counts:
    """Open items of one model or tenant, from the maintained totals (store.totals): the
    same cost at a million open items as at ten."""
    return totals.open_counts(session, registry.names, model=model, tenant_id=tenant_id)


def check_models(
    session: Session,
    models: list[str],
    new_tokens: dict[str, int],
    registry: Registry,
    settings: Settings,
) -> None:
    """Each of ``models`` (in that order): the batch's ``new_tokens`` for it against its
    bound, then, under the model's admission lock, its online backlog (this batch
    included)."""
    for model in models:
        spec = registry[model]
        bound = verdicts.backlog_bound_tokens(spec, settings)
        verdicts.check_batch_size(model, new_tokens[model], bound)
        # Serialize admissions per model so two submits cannot both squeeze in.
        session.execute(
            text("SELECT pg_advisory_xact_lock(:ns, hashtext(:key))"),
            {"ns": ADVISORY_NAMESPACE + 1, "key": model},
        )
        backlog = totals.total(_open(session, registry, model=model), ONLINE_OPEN_VALUES)
        verdicts.check_backlog(
            model, new_tokens[model], backlog.tokens_est, bound, spec.tokens_per_min
        )


def _tokens_used_on(session: Session, tenant_id: int, day: dt.date) -> int:
    used = session.scalar(
        select(
            func.coalesce(
                func.sum(TenantDailyUsage.prompt_tokens + TenantDailyUsage.completion_tokens), 0
            )
        ).where(TenantDailyUsage.tenant_id == tenant_id, TenantDailyUsage.day == day)
    )
    return int(used or 0)


def check_tenant(session: Session, tenant: Tenant, registry: Registry, models: list[str]) -> None:
    """The tenant's open items and tokens of the day, under its admission lock, against
    its own bounds (when it has any)."""
    if not verdicts.tenant_has_quotas(tenant.max_pending_items, tenant.daily_token_quota):
        return
    # One tenant's concurrent submits (for any models) are counted one after another.
    session.execute(
        text("SELECT pg_advisory_xact_lock(:ns, :tenant)"),
        {"ns": ADVISORY_NAMESPACE + 2, "tenant": tenant.id},
    )
    open_now = totals.total(_open(session, registry, tenant_id=tenant.id))
    verdicts.check_pending_items(
        tenant.name, open_now.items, tenant.max_pending_items, registry, models
    )
    if tenant.daily_token_quota is not None:
        now = session.scalar(select(func.now()))
        assert now is not None
        used = _tokens_used_on(session, tenant.id, now.astimezone(dt.UTC).date())
        verdicts.check_daily_tokens(
            tenant.name, used + open_now.tokens_est, tenant.daily_token_quota, now
        )
