"""Settling dollar reservations as each call is ledgered (docs/money.md).

Right after a transaction that wrote ledger rows commits (a batch item's answer, a
synchronous call's or a stream's, a pack's group commit, waste, a lost call, an
offloaded job's rows), each row's reservation ``<item>:<attempt>`` is released and
the row's price added to its budgets' ``used``
(:meth:`batchgen.limits.money_budgets.MoneyBudgets.release`): once, whoever asks again, and a
no-op where a rebuild released it first. Rows written in a session's transaction
are noted by :mod:`batchgen.store.ledger` and settled by a listener on the session's
commit (:func:`install`); the hot path's one-statement writes call :func:`settle`.

Settling is an optimisation of the rebuild, never needed for safety: a settle lost
(Redis away, this process killed between commit and settle) leaves its reservation
held until the next rebuild finds the row ledgered. So a tenant without a budget
costs no Redis round trip: which tenants have one is read once per
:data:`TENANTS_TTL_S` per process (a budget just made is settled by a rebuild).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from batchgen.domain.billing.budget_maths import to_micros
from batchgen.limits.backend import get_redis
from batchgen.limits.money_budgets import MoneyBudgets, Settle
from batchgen.store import budget_rows as store
from batchgen.store.db import session_scope
from batchgen.store.ledger import Ledgered, on_commit

log = logging.getLogger(__name__)

TENANTS_TTL_S = 5.0

_lock = threading.Lock()
_cache: tuple[float, frozenset[int]] = (-1.0, frozenset())


def budget_tenants(*, may_read: bool = True) -> frozenset[int] | None:
    """The tenants with a budget, as read at most :data:`TENANTS_TTL_S` ago; None when
    that is stale and ``may_read`` is False (a committing session's listener holds its
    connection: reading another could wait on a pool it exhausts)."""
    global _cache
    read_at, found = _cache
    if read_at >= 0 and time.monotonic() - read_at < TENANTS_TTL_S:
        return found
    if not may_read:
        return None
    with session_scope() as session:
        found = store.tenants_with_budgets(session)
    with _lock:
        _cache = (time.monotonic(), found)
    return found


def forget_budget_tenants() -> None:
    """Read the tenants with a budget afresh next time (a budget was set here)."""
    global _cache
    with _lock:
        _cache = (-1.0, frozenset())


def settle(rows: Sequence[Ledgered], *, may_read: bool = True) -> int:
    """Settle the reservations of ``rows`` (their transaction committed); returns how
    many budgets' reservations were released. ``may_read`` False: no database read
    (which tenants have a budget unknown: every row is settled, a no-op in Redis for
    those without one). Never raises: a settle lost is done by the next rebuild."""
    if not rows:
        return 0
    try:
        mine = budget_tenants(may_read=may_read)
        settles = [
            Settle(r.tenant_id, r.reservation_id, to_micros(r.cost_usd))
            for r in rows
            if mine is None or r.tenant_id in mine
        ]
        return MoneyBudgets(get_redis()).release(settles) if settles else 0
    except Exception as exc:  # noqa: BLE001 - the rebuild settles what this could not
        log.warning("settling %d reservations: %s", len(rows), type(exc).__name__)
        return 0


def _committed(rows: list[Ledgered]) -> None:
    settle(rows, may_read=False)


def install() -> None:
    """Settle what each committed session ledgered (once per process)."""
    on_commit(_committed)
