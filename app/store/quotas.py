"""Admission bounds checked at submit, inside the submit transaction.

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

A rejection raises, the transaction rolls back, and nothing is stored. The
pure functions first; the queries after.
"""

from __future__ import annotations

import datetime as dt
import math

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain.status import OPEN, ItemStatus, values
from batchgen.errors import FileQuotaExceeded, Overloaded, OverQuota, PayloadTooLarge
from batchgen.registry import ModelSpec, Registry
from batchgen.store import totals
from batchgen.store.db import ADVISORY_NAMESPACE
from batchgen.store.schema import File, Tenant, TenantDailyUsage

# A model's online backlog: what its workers still have to run (offloaded items wait
# for the provider's Batch API, on a quota of their own).
ONLINE_OPEN_VALUES = values(OPEN - {ItemStatus.OFFLOADED})
MIN_RETRY_AFTER_S = 1.0


def backlog_bound_tokens(spec: ModelSpec, settings: Settings) -> int:
    return spec.max_backlog_tokens or int(spec.tokens_per_min * settings.submit.max_backlog_min)


def drain_time_s(excess_tokens: int, tokens_per_min: int) -> float:
    """How long a model needs to work off ``excess_tokens`` at its rate."""
    return max(MIN_RETRY_AFTER_S, excess_tokens / (tokens_per_min / 60.0))


def seconds_until_utc_midnight(now: dt.datetime) -> float:
    tomorrow = (now.astimezone(dt.UTC) + dt.timedelta(days=1)).date()
    midnight = dt.datetime.combine(tomorrow, dt.time(), tzinfo=dt.UTC)
    return max(MIN_RETRY_AFTER_S, (midnight - now).total_seconds())


def file_quota(tenant: Tenant, settings: Settings) -> tuple[int, int]:
    """The tenant's bounds on its uploads: (files, bytes in all)."""
    return (
        tenant.max_files or settings.files.tenant_max_files,
        tenant.max_file_bytes or settings.files.tenant_max_file_bytes,
    )


def check_file_quota(
    tenant_name: str,
    new_bytes: int,
    kept: tuple[int, int],
    quota: tuple[int, int],
    first_expiry_s: float | None,
) -> None:
    """Pure: may a file of ``new_bytes`` join the ``kept`` (files, bytes) under
    ``quota``? A file that alone is over the bytes can never fit: 413. Otherwise over
    the quota: 429, back when the first kept file expires (``first_expiry_s`` from now)."""
    (files, used), (max_files, max_bytes) = kept, quota
    if new_bytes > max_bytes:
        raise PayloadTooLarge(
            f"a file of {new_bytes} bytes is over tenant {tenant_name}'s file quota of "
            f"{max_bytes} bytes",
            field="file",
        )
    retry_after_s = max(MIN_RETRY_AFTER_S, first_expiry_s or MIN_RETRY_AFTER_S)
    if files + 1 > max_files:
        raise FileQuotaExceeded(
            f"tenant {tenant_name} keeps {files} files; its quota is {max_files} files: "
            "delete one (DELETE /v1/files/{file_id}) or wait until one expires",
            retry_after_s=retry_after_s,
        )
    if used + new_bytes > max_bytes:
        raise FileQuotaExceeded(
            f"tenant {tenant_name} keeps {used} bytes of files; {new_bytes} more is over its "
            f"quota of {max_bytes} bytes: delete a file or wait until one expires",
            retry_after_s=retry_after_s,
        )


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
    check_file_quota(
        tenant.name,
        new_bytes,
        (int(files), int(used)),
        file_quota(tenant, settings),
        None if first_expiry_s is None else float(first_expiry_s),
    )


def _open(
    session: Session, registry: Registry, model: str | None = None, tenant_id: int | None = None
) -> totals.Counts:
    """Open items of one model or tenant, from the maintained totals (store.totals): the
    same cost at a million open items as at ten."""
    return totals.open_counts(session, registry.names, model=model, tenant_id=tenant_id)


def check_models(
    session: Session, new_tokens: dict[str, int], registry: Registry, settings: Settings
) -> None:
    """503 when a model's online backlog (this batch included) is over its bound."""
    for model in sorted(new_tokens):  # a fixed order: no deadlock between submits
        if not new_tokens[model]:
            continue  # all of it offloaded: not the online backlog
        spec = registry[model]
        bound = backlog_bound_tokens(spec, settings)
        if new_tokens[model] > bound:
            raise PayloadTooLarge(
                f"the batch's {new_tokens[model]} tokens for {model} exceed the model's "
                f"backlog bound of {bound} tokens; split it"
            )
        # Serialize admissions per model so two submits cannot both squeeze in.
        session.execute(
            text("SELECT pg_advisory_xact_lock(:ns, hashtext(:key))"),
            {"ns": ADVISORY_NAMESPACE + 1, "key": model},
        )
        backlog = totals.total(_open(session, registry, model=model), ONLINE_OPEN_VALUES)
        backlog_tokens = backlog.tokens_est
        if backlog_tokens > bound:
            raise Overloaded(
                f"model {model} is overloaded: {backlog_tokens - new_tokens[model]} tokens "
                f"are waiting (bound {bound}); retry later",
                retry_after_s=drain_time_s(backlog_tokens - bound, spec.tokens_per_min),
            )


def check_tenant(session: Session, tenant: Tenant, registry: Registry, models: list[str]) -> None:
    """429 when the tenant is over its own open-items or daily-token bounds."""
    if tenant.max_pending_items is None and tenant.daily_token_quota is None:
        return
    # One tenant's concurrent submits (for any models) are counted one after another.
    session.execute(
        text("SELECT pg_advisory_xact_lock(:ns, :tenant)"),
        {"ns": ADVISORY_NAMESPACE + 2, "tenant": tenant.id},
    )
    open_now = totals.total(_open(session, registry, tenant_id=tenant.id))
    if tenant.max_pending_items is not None:
        open_items = open_now.items
        if open_items > tenant.max_pending_items:
            rpm = max(registry[m].requests_per_min for m in models)
            excess = open_items - tenant.max_pending_items
            raise OverQuota(
                f"tenant {tenant.name} would have {open_items} open items; its limit is "
                f"{tenant.max_pending_items}",
                retry_after_s=max(MIN_RETRY_AFTER_S, math.ceil(excess * 60 / rpm)),
            )
    if tenant.daily_token_quota is not None:
        now = session.scalar(select(func.now()))
        assert now is not None
        used = (
            session.scalar(
                select(
                    func.coalesce(
                        func.sum(
                            TenantDailyUsage.prompt_tokens + TenantDailyUsage.completion_tokens
                        ),
                        0,
                    )
                ).where(
                    TenantDailyUsage.tenant_id == tenant.id,
                    TenantDailyUsage.day == now.astimezone(dt.UTC).date(),
                )
            )
            or 0
        )
        committed = int(used) + open_now.tokens_est
        if committed > tenant.daily_token_quota:
            raise OverQuota(
                f"tenant {tenant.name} would use {committed} tokens today; its daily quota is "
                f"{tenant.daily_token_quota}",
                retry_after_s=seconds_until_utc_midnight(now),
            )
