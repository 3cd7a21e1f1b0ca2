"""The invariants every fault test checks once its run has ended, in one place.

- every item is terminal;
- one result per succeeded item, none for the others;
- ledger = results + waste (per item and in total);
- ``tenant_daily_usage`` = the ledger's totals per tenant, day and model;
- no provider call counted twice unless ledgered as waste: the simulator's own
  request log (``GET /_sim/log``, entries carry the item id of the
  ``x-batchgen-item`` header) is matched per item against the ledger: every call
  the provider answered or may bill has exactly one ledger row, every result is
  one of the item's answered calls, and no unknown item id reached the provider;
- every concurrency slot and budget reservation is released: no live slot is
  held, the budget's running totals agree with its entries, and no reservation
  is kept for a call that never reached the provider.

:func:`check_invariants` returns what it saw (:class:`RunReport`), so a test
can also prove that its fault really hit (calls cut mid-flight, items retried).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import redis
from sqlalchemy import Date, cast, func, select

from batchgen.domain.lifecycle.status import TERMINAL
from batchgen.limits import redis_keys as keys
from batchgen.registry import get_registry
from batchgen.store import db
from batchgen.store.schema import Item, Result, Tenant, TenantDailyUsage, UsageLedger
from tests import http_client
from tests.helpers import assert_ledger_is_results_plus_waste
from tests.waiting import poll_until
from tests.waiting import wait_until as wait_until  # re-exported: where tests import it

SHOWN = 10  # offending items listed in a failure message


@dataclass(frozen=True)
class RunReport:
    """What the invariants saw, for a test's own proof that its fault hit."""

    statuses: dict[str, int]
    billed_calls: int
    cut_calls: int  # admitted by the provider, then cut before the answer was complete
    retried_items: int  # items with more than one attempt
    waste_rows: int
    calls_per_item: dict[int, int] = field(repr=False)


def reset_simulator(base_url: str) -> None:
    """Forget the simulator's request log and counters (ids restart with each clean test)."""
    http_client.post(f"{base_url}/_sim/reset", timeout=10).raise_for_status()


def simulator_log(base_url: str) -> list[dict[str, Any]]:
    return list(http_client.get(f"{base_url}/_sim/log", timeout=30).json())


def is_billed(entry: dict[str, Any]) -> bool:
    """The provider admitted the call (counted it against the limits, may bill it),
    and did not answer with a server error (a 5xx is not billed)."""
    status = entry["status"]
    return bool(entry["admitted"]) and (status is None or status < 500)


def cut_calls(base_url: str) -> int:
    """Calls the provider admitted that ended before their answer was complete (the
    client went away mid-call): proof that a fault hit calls in flight."""
    return sum(1 for e in simulator_log(base_url) if is_billed(e) and not e["completed"])


class Findings:
    """Broken invariants, collected so that one failure names every one of them."""

    def __init__(self) -> None:
        self.sections: list[str] = []

    def add(self, title: str, problems: list[str]) -> None:
        if problems:
            more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
            self.sections.append(f"{title}: " + "; ".join(problems[:SHOWN]) + more)

    def raise_if_any(self) -> None:
        if self.sections:
            raise AssertionError("invariants broken:\n- " + "\n- ".join(self.sections))


def _items() -> dict[int, tuple[str, int]]:
    with db.session_scope() as s:
        return {i: (st, a) for i, st, a in s.execute(select(Item.id, Item.status, Item.attempts))}


def _check_terminal(items: dict[int, tuple[str, int]], findings: Findings) -> None:
    stuck = [f"item {i} is {st}" for i, (st, _) in sorted(items.items()) if st not in TERMINAL]
    findings.add("items not terminal", stuck)


def _check_results_and_ledger(
    items: dict[int, tuple[str, int]], findings: Findings
) -> dict[int, list[Any]]:
    """One result per succeeded item, each with its own non-waste ledger row; returns
    the ledger rows per item."""
    with db.session_scope() as s:
        results = {r.item_id: r for r in s.scalars(select(Result))}
        ledger_rows = list(s.execute(select(UsageLedger)).scalars())
    ledger: dict[int, list[Any]] = defaultdict(list)
    for row in ledger_rows:
        ledger[row.item_id].append(row)
    succeeded = {i for i, (st, _) in items.items() if st == "succeeded"}
    problems = [f"item {i} succeeded without a result" for i in sorted(succeeded - set(results))]
    problems += [f"item {i} is {items[i][0]} but has a result" for i in set(results) - succeeded]
    for item_id in sorted(items):
        paid = [r for r in ledger.get(item_id, []) if r.waste_reason is None]
        expected = 1 if item_id in succeeded else 0
        if len(paid) != expected:
            problems.append(f"item {item_id}: {len(paid)} non-waste ledger rows, want {expected}")
        result = results.get(item_id)
        if result is not None and paid:
            row = paid[0]
            same = (row.attempt, row.prompt_tokens, row.completion_tokens, row.cost_usd) == (
                result.attempt,
                result.prompt_tokens,
                result.completion_tokens,
                result.cost_usd,
            )
            if not same:
                problems.append(f"item {item_id}: result and its ledger row disagree")
    findings.add("results vs ledger", problems)
    try:
        assert_ledger_is_results_plus_waste()
    except AssertionError as exc:
        findings.add("ledger totals are not results + waste", [str(exc)])
    return ledger


def _direct_counts() -> dict[tuple[str, int, str], tuple[int, int]]:
    """Items and estimated tokens per (model, tenant, status), counted one by one."""
    with db.session_scope() as s:
        rows = s.execute(
            select(
                Item.model,
                Item.tenant_id,
                Item.status,
                func.count(),
                func.sum(Item.prompt_tokens_est + Item.max_tokens),
            ).group_by(Item.model, Item.tenant_id, Item.status)
        )
        return {(m, t, st): (int(n), int(tok)) for m, t, st, n, tok in rows}


def _direct_batches_and_latencies() -> tuple[dict[str, dict[str, int]], dict[Any, list[Any]]]:
    """Finished items per batch and status, and the latency buckets, counted directly."""
    from batchgen.domain.lifecycle.status import TERMINAL as ENDED
    from batchgen.store import totals

    with db.session_scope() as s:
        per_batch: dict[str, dict[str, int]] = defaultdict(dict)
        for batch_id, status, n in s.execute(
            select(Item.batch_id, Item.status, func.count())
            .where(Item.status.in_([st.value for st in ENDED]))
            .group_by(Item.batch_id, Item.status)
        ):
            per_batch[batch_id][status] = n
        buckets: dict[Any, Counter[int]] = defaultdict(Counter)
        sums: dict[Any, int] = defaultdict(int)
        for model, wait_ms, upstream_ms in s.execute(
            select(Item.model, Result.queue_wait_ms, Result.upstream_latency_ms).join(
                Item, Item.id == Result.item_id
            )
        ):
            for metric, ms in (("queue_wait", wait_ms), ("upstream", upstream_ms)):
                le = next((b for b in totals.LATENCY_BOUNDS_MS if b >= ms), totals.LE_INF_MS)
                buckets[(model, metric)][le] += 1
                sums[(model, metric)] += ms
    latencies = {k: sorted(v.items()) + [("sum", sums[k])] for k, v in buckets.items()}
    return dict(per_batch), latencies


def _maintained() -> tuple[dict[Any, tuple[int, int]], dict[str, dict[str, int]], dict[Any, Any]]:
    from batchgen.store import totals

    with db.session_scope() as s:
        s.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        counts = {**totals.finished(s), **totals.open_counts(s, get_registry().names)}
        batch_ids = list(s.scalars(select(Item.batch_id).distinct()))
        per_batch = totals.batches_finished(s, batch_ids)
        latencies = {
            k: [(le, n) for le, n, _ in rows] + [("sum", sum(ms for _, _, ms in rows))]
            for k, rows in totals.latency_buckets(s).items()
        }
    found = {k: (c.items, c.tokens_est) for k, c in counts.items() if c.items or c.tokens_est}
    return found, per_batch, latencies


def check_totals(findings: Findings | None = None) -> None:
    """The maintained totals (store.totals) equal a count of the items one by one, before
    and after a roll-up of everything that finished (nothing may be counted twice)."""
    from batchgen.store import totals

    own = findings or Findings()
    direct = _direct_counts()
    direct_batches, direct_latencies = _direct_batches_and_latencies()
    for when in ("before the roll-up", "after the roll-up"):
        maintained, batches, latencies = _maintained()
        problems = [
            f"{key}: maintained {maintained.get(key)}, counted {direct.get(key)}"
            for key in sorted(set(direct) | set(maintained), key=str)
            if maintained.get(key) != direct.get(key)
        ]
        if batches != direct_batches:
            problems.append(f"per batch: maintained {batches}, counted {direct_batches}")
        if latencies != direct_latencies:
            problems.append(f"latencies: maintained {latencies}, counted {direct_latencies}")
        own.add(f"totals {when}", problems)
        with db.session_scope() as s:
            totals.roll_up(s, wait=True, lag_s=0)
    if findings is None:
        own.raise_if_any()


def _check_daily_usage(findings: Findings) -> None:
    """``tenant_daily_usage`` holds exactly the ledger's totals per tenant, UTC day, model."""
    u = UsageLedger
    day = cast(func.timezone("UTC", u.created_at), Date)
    with db.session_scope() as s:
        from_ledger = {
            (t, d, m): (n, int(p), int(c), Decimal(cost))
            for t, d, m, n, p, c, cost in s.execute(
                select(
                    u.tenant_id,
                    day,
                    u.model,
                    func.count(),
                    func.sum(u.prompt_tokens),
                    func.sum(u.completion_tokens),
                    func.sum(u.cost_usd),
                ).group_by(u.tenant_id, day, u.model)
            )
        }
        d = TenantDailyUsage
        daily = {
            (t, dd, m): (int(n), int(p), int(c), Decimal(cost))
            for t, dd, m, n, p, c, cost in s.execute(
                select(
                    d.tenant_id,
                    d.day,
                    d.model,
                    func.sum(d.requests),
                    func.sum(d.prompt_tokens),
                    func.sum(d.completion_tokens),
                    func.sum(d.cost_usd),
                ).group_by(d.tenant_id, d.day, d.model)  # the sum of its shards
            )
        }
    problems = [
        f"{key}: daily usage {daily.get(key)} vs ledger {from_ledger.get(key)}"
        for key in sorted(set(from_ledger) | set(daily), key=str)
        if daily.get(key) != from_ledger.get(key)
    ]
    findings.add("tenant_daily_usage is not the ledger's totals", problems)


def _check_provider_log(
    log: list[dict[str, Any]],
    items: dict[int, tuple[str, int]],
    ledger: dict[int, list[Any]],
    worker_killed: bool,
    findings: Findings,
) -> tuple[Counter[int], int]:
    """Every call the provider may bill has exactly one ledger row; every result is
    one of the item's answered calls. Returns billed calls per item and cut calls."""
    billed: Counter[int] = Counter()
    answered: dict[int, set[str]] = defaultdict(set)
    problems: list[str] = []
    cut = 0
    for entry in log:
        raw = entry.get("item")
        try:
            item_id = int(raw)
        except (TypeError, ValueError):
            problems.append(f"a call with item header {raw!r} reached the provider")
            continue
        if item_id not in items:
            problems.append(f"a call for unknown item {item_id} reached the provider")
            continue
        if is_billed(entry):
            billed[item_id] += 1
            if not entry["completed"]:
                cut += 1
        if entry["status"] == 200 and entry["completed"]:
            answered[item_id].add(entry["request_id"])
    with db.session_scope() as s:
        result_ids = dict(s.execute(select(Result.item_id, Result.provider_request_id)).all())
    for item_id in sorted(set(billed) | set(ledger)):
        rows = ledger.get(item_id, [])
        extra = len(rows) - billed[item_id]
        wasted = sum(1 for r in rows if r.waste_reason)
        retried = items.get(item_id, ("", 0))[1] > 1
        # A killed worker cannot say whether it had sent its call: a waste row for a
        # call that never left is the safe side then, and only then.
        unknowable = worker_killed and retried and 0 < extra <= wasted
        if extra != 0 and not unknowable:
            reasons = sorted(str(r.waste_reason) for r in rows)
            problems.append(
                f"item {item_id}: {billed[item_id]} billed calls at the provider, "
                f"{len(rows)} ledger rows {reasons}"
            )
    for item_id, request_id in sorted(result_ids.items()):
        if request_id not in answered.get(item_id, set()):
            problems.append(f"item {item_id}: result {request_id} is not an answered call of it")
    findings.add("provider calls vs ledger (simulator request log)", problems)
    return billed, cut


def _redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + micros / 1_000_000


def _live_slots(client: redis.Redis) -> dict[str, list[str]]:
    now = _redis_now(client)
    held = {}
    for spec in get_registry():
        members = client.zrangebyscore(keys.slots(spec.name), now, "+inf")
        if members:
            held[spec.name] = [m.decode() for m in members]
    return held


def _check_slots(client: redis.Redis, grace_s: float, findings: Findings) -> None:
    poll_until(lambda: not _live_slots(client), grace_s)
    held = _live_slots(client)
    findings.add("concurrency slots still held", [f"{m}: {h}" for m, h in held.items()])


def _budget_keys() -> list[tuple[str, str, bool]]:
    """(log key, amounts key, counts requests) of every model and tenant budget."""
    out = {
        (keys.budget_log(s.budget_key), keys.budget_amounts(s.budget_key), True)
        for s in get_registry()
    }
    with db.session_scope() as s:
        tenant_ids = [0, *s.scalars(select(Tenant.id))]
    out |= {(keys.tenant_log(t), keys.tenant_amounts(t), False) for t in tenant_ids}
    return sorted(out)


def _check_reservations(
    client: redis.Redis,
    billed: Counter[int],
    items: dict[int, tuple[str, int]],
    tolerate_retried: bool,
    findings: Findings,
) -> None:
    """Running totals agree with the entries, and every reservation still on the books
    belongs to a call that reached the provider (a call that never did must give its
    reservation back)."""
    problems: list[str] = []
    for log_key, amounts_key, counts_requests in _budget_keys():
        members = {m.decode() for m in client.zrange(log_key, 0, -1)}
        amounts = {k.decode(): int(v) for k, v in client.hgetall(amounts_key).items()}
        entries = {k: v for k, v in amounts.items() if not k.startswith("_")}
        if set(entries) != members:
            problems.append(f"{log_key}: log and amounts disagree")
        if amounts.get("_tokens", 0) != sum(entries.values()):
            problems.append(
                f"{amounts_key}: _tokens={amounts.get('_tokens', 0)} but the entries hold "
                f"{sum(entries.values())}"
            )
        if counts_requests:
            requests = sum(1 for m in entries if not m.startswith("o:"))
            if amounts.get("_requests", 0) != requests:
                problems.append(
                    f"{amounts_key}: _requests={amounts.get('_requests', 0)} but {requests} "
                    "reservations"
                )
        # "rebuilt:": a budget restarted as spent after Redis lost it (no item's).
        per_item = Counter(
            int(m.split(":", 1)[0]) for m in members if not m.startswith(("o:", "rebuilt:"))
        )
        for item_id, kept in sorted(per_item.items()):
            retried = items.get(item_id, ("", 0))[1] > 1
            if kept > billed[item_id] and not (tolerate_retried and retried):
                problems.append(
                    f"{log_key}: item {item_id} keeps {kept} reservations for "
                    f"{billed[item_id]} calls that reached the provider"
                )
    findings.add("budget reservations", problems)


def check_invariants(
    simulator_url: str,
    redis_client: redis.Redis,
    *,
    slot_grace_s: float = 5.0,
    worker_killed: bool = False,
) -> RunReport:
    """Check every invariant of a finished run (see the module docstring).

    ``redis_client`` is the Redis the workers used for budgets and slots.
    ``slot_grace_s`` is how long a slot may still be held after the last item ended
    (a killed worker's slots free themselves when their lease ends).
    ``worker_killed``: a worker was killed mid-run. It cannot give back the reservation
    of a call it had not sent yet, nor can anyone tell whether it had sent it, so a
    retried item may keep such a reservation and carry a waste row for such a call.
    """
    items = _items()
    assert items, "the run stored no items"
    findings = Findings()
    _check_terminal(items, findings)
    ledger = _check_results_and_ledger(items, findings)
    _check_daily_usage(findings)
    check_totals(findings)
    log = simulator_log(simulator_url)
    billed, cut = _check_provider_log(log, items, ledger, worker_killed, findings)
    _check_slots(redis_client, slot_grace_s, findings)
    _check_reservations(redis_client, billed, items, worker_killed, findings)
    findings.raise_if_any()
    return RunReport(
        statuses=dict(Counter(st for st, _ in items.values())),
        billed_calls=sum(billed.values()),
        cut_calls=cut,
        retried_items=sum(1 for _, a in items.values() if a > 1),
        waste_rows=sum(1 for rows in ledger.values() for r in rows if r.waste_reason),
        calls_per_item=dict(billed),
    )


def assert_budget_settled(tenant: str, timeout_s: float = 60.0) -> None:
    """The tenant's dollar budget, once settled (a read of it rebuilds it from the
    ledger), holds no reservation and its ``used`` is the ledger's spend: nothing was
    reserved twice or left held by the fault."""
    from batchgen import tenant_admin
    from batchgen.domain.billing.budget_maths import to_micros

    def budget() -> dict[str, Any]:
        (found,) = tenant_admin.get_budgets(tenant)
        return found

    wait_until(lambda: budget()["reserved_micros"] == 0, timeout_s, lambda: str(budget()))
    with db.session_scope() as session:
        spent = session.scalar(
            select(func.coalesce(func.sum(UsageLedger.cost_usd), 0))
            .join(Tenant, Tenant.id == UsageLedger.tenant_id)
            .where(Tenant.name == tenant)
        )
    assert budget()["used_micros"] == to_micros(spent)
