"""Dollar budgets in Redis: reserve a call's worst case, settle it once.

One hash per budget and period (:func:`batchgen.limits.redis_keys.money`) holds what
was settled (``used``: the ledger's spend of the period at its last rebuild, plus the
prices settled since, each rounded up), what is
reserved, and each reservation by its id (``<item>:<attempt>``, or a synchronous
call's id before its item exists). :meth:`MoneyBudgets.reserve` is all or nothing
across the budgets a call counts against (``lua/money_reserve.lua``) and idempotent
per id, and notes in an index of its own (:func:`~batchgen.limits.redis_keys.money_reservation`)
the hashes it is held in; :meth:`MoneyBudgets.release` settles it by that index right
after its call's ledger row is written: released and its actual price added to
``used``, once (the index is deleted; an id not held is a no-op);
:meth:`MoneyBudgets.adopt` moves a synchronous call's reservation to its item's id once
the item is stored. :meth:`MoneyBudgets.sync` rebuilds a period from
the ledger (``lua/money_settle.lua``): after Redis lost its data, at a new period,
and whenever a reservation is refused, so what ended is released and what is in
flight stays held. The maths is in :mod:`batchgen.domain.billing.budget_maths`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import script, scripts_at_once


@dataclass(frozen=True)
class Ask:
    """One budget a reservation counts against: its hash, the amount and its limit."""

    key: str
    amount_micros: int
    limit_micros: int


@dataclass(frozen=True)
class Reply:
    granted: bool
    held_before: bool = False
    # Refused or not built: the index (0-based) of the budget that said so.
    index: int = -1
    unbuilt: bool = False  # the budget's period has not been built from the ledger
    used_micros: int = 0
    reserved_micros: int = 0


@dataclass(frozen=True)
class Settle:
    """A reservation to settle: its tenant, its id and the price its ledger row holds."""

    tenant_id: int
    reservation_id: str
    actual_micros: int


@dataclass(frozen=True)
class Level:
    used_micros: int
    reserved_micros: int


class MoneyBudgets:
    """Reserve, settle and sync dollar budgets (global across all workers)."""

    def __init__(self, client: redis.Redis):
        self.client = client

    def reserve(
        self,
        tenant_id: int,
        reservation_id: str,
        asks: Sequence[Ask],
        ttl_s: float,
        now_s: float | None = None,
    ) -> Reply:
        if not asks:
            return Reply(True)
        args: list[str | int | float] = [reservation_id, "" if now_s is None else repr(now_s)]
        args.append(ttl_s)
        for a in asks:
            args += [a.amount_micros, a.limit_micros]
        names = [a.key for a in asks] + [keys.money_reservation(tenant_id, reservation_id)]
        reply = script(self.client, "money_reserve")(keys=names, args=args)
        code = int(reply[0])
        if code == 1:
            return Reply(True, held_before=bool(int(reply[1])))
        if code == -2:
            return Reply(False, index=int(reply[1]) - 1, unbuilt=True)
        return Reply(
            False, index=int(reply[1]) - 1, used_micros=int(reply[2]), reserved_micros=int(reply[3])
        )

    def release(self, settles: Sequence[Settle]) -> int:
        """Settle each reservation (its actual price into ``used``), once, in one round
        trip; returns how many budgets' reservations were released."""
        calls: list[tuple[list[str], list[Any]]] = [
            (
                [keys.money_reservation(s.tenant_id, s.reservation_id)],
                ["settle", s.reservation_id, max(0, s.actual_micros)],
            )
            for s in settles
        ]
        return sum(int(r) for r in scripts_at_once(self.client, "money_release", calls))

    def adopt(self, tenant_id: int, old_id: str, new_id: str) -> bool:
        """Move the reservation ``old_id`` (a synchronous call's, before its item existed)
        to ``new_id`` (its item's ``<item>:<attempt>``)."""
        names = [keys.money_reservation(tenant_id, i) for i in (old_id, new_id)]
        reply = script(self.client, "money_release")(keys=names, args=["adopt", old_id, new_id])
        return bool(int(reply))

    def settle(self, key: str, reservation_id: str, actual_micros: int) -> bool:
        """Release ``reservation_id`` and add ``actual_micros`` to what is used, once."""
        reply = script(self.client, "money_settle")(
            keys=[key], args=["settle", reservation_id, max(0, actual_micros)]
        )
        return bool(int(reply[0]))

    def sync(
        self,
        key: str,
        spend_micros: int,
        cutoff_s: float,
        in_flight: Sequence[tuple[str, int]],
        ttl_s: float,
        done: Sequence[str] = (),
    ) -> Level:
        """Rebuild from the ledger: ``used`` becomes ``spend_micros``; reservations
        made before ``cutoff_s`` (Redis seconds) that are not ``in_flight`` released;
        those in flight held (added if missing); those ``done`` (ledgered) released
        whatever their age."""
        args: list[str | int | float] = ["sync", spend_micros, repr(cutoff_s), ttl_s]
        args.append(len(done))
        args += list(done)
        for rid, amount in in_flight:
            args += [rid, amount]
        reply = script(self.client, "money_settle")(keys=[key], args=args)
        return Level(int(reply[0]), int(reply[1]))

    def held(self, key: str) -> list[str]:
        """The ids of the reservations the period holds."""
        return [
            f.decode()[2:] if isinstance(f, bytes) else str(f)[2:]
            for f in self.client.hkeys(key)
            if (f.decode() if isinstance(f, bytes) else str(f)).startswith("r:")
        ]

    def level(self, key: str) -> Level | None:
        """What the period holds now (None: not built)."""
        used, reserved = self.client.hmget(key, ["used", "reserved"])
        if used is None:
            return None
        return Level(int(used), int(reserved or 0))

    def now_s(self) -> float:
        sec, usec = self.client.time()
        return sec + usec / 1_000_000

    def alert_once(
        self, tenant_id: int, budget_id: int, period_key: str, pct: int, ttl_s: float
    ) -> bool:
        """True the first time the period's ``pct`` threshold is claimed (SET NX)."""
        name = keys.money_alert(tenant_id, budget_id, period_key, pct)
        return bool(self.client.set(name, "1", nx=True, ex=max(1, int(ttl_s))))
