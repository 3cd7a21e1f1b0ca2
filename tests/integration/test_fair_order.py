"""The dispatcher's fair order (deficit round robin across tenants, app/store/rounds.py;
turns between a tenant's open batches) on a real database.

No worker runs: each test stores batches through the Python API (its dispatcher
wake-up goes to a broker nobody consumes), calls ``release_model`` in a session as
the dispatcher would, and reads which items became ``queued``. Where workers would
finish items between two releases, the test marks them ``succeeded`` itself.
"""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import func, select, text, update

from batchgen import python_api as client
from batchgen.config import Settings, get_settings
from batchgen.registry import ModelSpec, get_registry
from batchgen.store import db
from batchgen.store.schema import Batch, Item, Tenant
from batchgen.worker.dispatch import release_model
from tests.helpers import chat_line, make_tenant

pytestmark = pytest.mark.integration

MODEL = "sim-small"


@pytest.fixture
def dispatch_ahead(clean_db: dict[str, str]) -> Iterator[Callable[[float], Settings]]:
    """``dispatch_ahead(factor)``: settings with BATCHGEN_DISPATCH_AHEAD_FACTOR set, so
    one release fills ``ceil(max_concurrency * factor)`` slots; put back after the test."""
    name = "BATCHGEN_DISPATCH_AHEAD_FACTOR"
    saved = os.environ.get(name)

    def set_factor(factor: float) -> Settings:
        os.environ[name] = str(factor)
        get_settings.cache_clear()
        settings = get_settings()
        assert settings.worker.dispatch_ahead_factor == factor
        return settings

    yield set_factor
    if saved is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = saved
    get_settings.cache_clear()


def spec() -> ModelSpec:
    return get_registry()[MODEL]


def window(settings: Settings) -> int:
    """Items the model may have queued or running at once (the dispatcher's formula)."""
    return max(1, math.ceil(spec().max_concurrency * settings.worker.dispatch_ahead_factor))


def submit(tenant: str, prefix: str, n: int, priority: str = "interactive") -> str:
    rows = [chat_line(f"{prefix}{i}", model=MODEL, max_tokens=5) for i in range(n)]
    return str(client.submit_batch(rows, tenant=tenant, priority=priority)["id"])


def release(settings: Settings) -> list[tuple[str, str]]:
    """One dispatch of the model; ``(tenant name, custom_id)`` of every item released,
    in release order."""
    with db.session_scope() as session:
        released = release_model(session, spec(), settings)
        ids = [r.item_id for r in released]
        rows = session.execute(
            select(Item.id, Tenant.name, Item.custom_id, Item.status)
            .select_from(Item)
            .join(Tenant, Tenant.id == Item.tenant_id)
            .where(Item.id.in_(ids))
        ).all()
    assert all(row.status == "queued" for row in rows), rows
    assert len(rows) == len(ids)
    found = {row.id: (row.name, row.custom_id) for row in rows}
    return [found[item_id] for item_id in ids]


def in_flight() -> Counter[str]:
    """Queued or running items of the model, per tenant name."""
    with db.session_scope() as session:
        rows = session.execute(
            select(Tenant.name, func.count())
            .select_from(Item)
            .join(Tenant, Tenant.id == Item.tenant_id)
            .where(Item.model == MODEL, Item.status.in_(["queued", "running"]))
            .group_by(Tenant.name)
        ).all()
    return Counter(dict(rows))


def finish(tenant: str | None = None, *, share: float = 1.0, seed: int = 0) -> int:
    """Mark in-flight items ``succeeded`` as workers would: all of them (or of one
    tenant's), or a seeded random ``share`` of them, rounded down. Returns how many."""
    with db.session_scope() as session:
        query = select(Item.id).where(Item.status.in_(["queued", "running"]))
        if tenant is not None:
            query = query.where(Item.tenant_id.in_(select(Tenant.id).where(Tenant.name == tenant)))
        ids = sorted(session.scalars(query))
        chosen = random.Random(seed).sample(ids, math.floor(len(ids) * share))
        if chosen:
            session.execute(
                update(Item)
                .where(Item.id.in_(chosen))
                .values(status="succeeded", started_at=func.now(), finished_at=func.now())
            )
    return len(chosen)


def statuses(batch_id: str) -> Counter[str]:
    with db.session_scope() as session:
        rows = session.execute(
            select(Item.status, func.count()).where(Item.batch_id == batch_id).group_by(Item.status)
        ).all()
    return Counter(dict(rows))


def test_weights_split_releases_two_to_one(dispatch_ahead):
    settings = dispatch_ahead(2.0)
    slots = window(settings)
    assert slots >= 24  # enough slots for a 2:1 split to show
    make_tenant("heavy", weight=2)
    make_tenant("light", weight=1)
    # Both backlogs outlast every round; "light" submits first, so submission order
    # alone would favour it.
    submit("light", "l", 300)
    submit("heavy", "h", 300)

    released: Counter[str] = Counter()
    for round_no in range(10):
        got = Counter(name for name, _ in release(settings))
        released.update(got)
        held = in_flight()
        assert held.total() == slots, (round_no, held)  # every free slot was used
        # Each release tops the tenants up to their weighted share of the slots:
        # 2/3 and 1/3, give or take the one slot that cannot be split.
        assert abs(held["heavy"] - 2 * slots / 3) <= 1.5, (round_no, held)
        assert abs(held["light"] - slots / 3) <= 1.5, (round_no, held)
        # Before the next release, workers finish half of each tenant's items in flight.
        for tenant in ("heavy", "light"):
            assert finish(tenant, share=0.5, seed=round_no) == held[tenant] // 2

    # Over the rounds, the releases follow the weights.
    ratio = released["heavy"] / released["light"]
    assert 1.85 <= ratio <= 2.25, released


def test_interactive_before_bulk_and_open_batches_take_turns(dispatch_ahead):
    settings = dispatch_ahead(0.25)
    slots = window(settings)
    assert slots == 4  # sim-small: max_concurrency 16
    make_tenant("solo")
    # Submission order: bulk b, interactive i, bulk c, interactive j.
    submit("solo", "b", 5, priority="bulk")
    submit("solo", "i", 5, priority="interactive")
    submit("solo", "c", 5, priority="bulk")
    submit("solo", "j", 5, priority="interactive")

    rounds: list[set[str]] = []
    while got := release(settings):
        rounds.append({custom_id for _, custom_id in got})
        finish()
        assert len(rounds) <= 10, rounds

    # Interactive before bulk; the batches of one priority take turns, the earlier
    # submitted first in each turn.
    expected = [f"{b}{n}" for n in range(5) for b in "ij"]
    expected += [f"{b}{n}" for n in range(5) for b in "bc"]
    assert rounds == [set(expected[k : k + slots]) for k in range(0, len(expected), slots)]


def test_a_new_batch_takes_turns_with_what_older_ones_have_left(dispatch_ahead):
    """A tenant's batch submitted while its earlier batch is half released does not wait
    behind the rest of it: from its submit on, the two take turns."""
    settings = dispatch_ahead(2.0)
    slots = window(settings)
    make_tenant("shop")
    first = submit("shop", "a", 200)
    for _ in range(2):
        assert len(release(settings)) == slots
        finish()
    second = submit("shop", "n", 10)
    got = [custom_id for _, custom_id in release(settings)]
    assert statuses(second) == {"queued": 10}, got
    assert statuses(first)["queued"] == slots - 10
    # Released in turns: one of each while both have items (a0-a63 went before).
    assert got[:20] == [c for n in range(10) for c in (f"a{64 + n}", f"n{n}")], got


def test_more_tenants_than_places_are_served_in_turn_across_rounds(dispatch_ahead):
    """The ring remembers where a round stopped: with 10 tenants and 4 places a round,
    the next round serves the next tenants, and over five rounds each is served twice."""
    settings = dispatch_ahead(0.25)
    assert window(settings) == 4
    names = [f"t{n}" for n in range(10)]
    for name in names:
        make_tenant(name)
        submit(name, name, 20)
    served: Counter[str] = Counter()
    rounds = []
    for _ in range(5):
        got = [name for name, _ in release(settings)]
        rounds.append(got)
        served.update(got)
        finish()
    assert rounds[:3] == [names[:4], names[4:8], names[8:] + names[:2]], rounds
    assert served == {name: 2 for name in names}, rounds


def test_a_turn_cut_short_by_the_round_goes_on_in_the_next(dispatch_ahead):
    """Weights hold over rounds smaller than a turn: a tenant of weight 3 and one of
    weight 1, two places a round, get releases 3 to 1 (the deficit left at the end of a
    round is carried into the next)."""
    settings = dispatch_ahead(0.125)
    assert window(settings) == 2
    make_tenant("heavy", weight=3)
    make_tenant("light", weight=1)
    submit("heavy", "h", 50)
    submit("light", "l", 50)
    rounds = []
    for _ in range(4):
        rounds.append(Counter(name for name, _ in release(settings)))
        finish()
    assert rounds == [{"heavy": 2}, {"heavy": 1, "light": 1}] * 2, rounds


def test_an_idle_tenant_takes_no_share(dispatch_ahead):
    settings = dispatch_ahead(2.0)
    slots = window(settings)
    # "idle" has the largest weight and a finished batch, but nothing pending.
    make_tenant("idle", weight=5)
    make_tenant("a")
    make_tenant("b")
    done = submit("idle", "x", 10)
    while release(settings):
        finish()
    assert statuses(done) == {"succeeded": 10}

    submit("a", "a", 100)
    submit("b", "b", 100)
    got = Counter(name for name, _ in release(settings))
    # The idle tenant's share goes to the tenants with work: no slot is left empty.
    assert got == {"a": slots // 2, "b": slots // 2}


def test_cancelled_batches_and_future_not_before_are_not_released(dispatch_ahead):
    settings = dispatch_ahead(2.0)
    slots = window(settings)
    make_tenant("t")
    cancelled = submit("t", "x", 5)
    requested = submit("t", "r", 5)
    delayed = submit("t", "d", 10)
    plain = submit("t", "p", 5)
    client.cancel_batch(cancelled, tenant="t")
    with db.session_scope() as session:
        # A cancel requested whose items are still pending (the moment between the
        # request and the items' update): the dispatcher must skip them.
        session.execute(
            update(Batch).where(Batch.id == requested).values(cancel_requested_at=func.now())
        )
        for custom_id, delay in (
            ("d0", "1 hour"),
            ("d1", "1 hour"),
            ("d2", "1 minute"),
            ("d3", "10 seconds"),
        ):
            session.execute(
                update(Item)
                .where(Item.batch_id == delayed, Item.custom_id == custom_id)
                .values(not_before=func.now() + text(f"interval '{delay}'"))
            )
        for custom_id in ("d4", "d5"):  # a not_before already past holds nothing back
            session.execute(
                update(Item)
                .where(Item.batch_id == delayed, Item.custom_id == custom_id)
                .values(not_before=func.now() - text("interval '1 second'"))
            )
    assert statuses(requested) == {"pending": 5}

    got = {custom_id for _, custom_id in release(settings)}
    assert len(got) < slots  # room was left: what stayed behind was held back
    assert got == {f"d{n}" for n in range(4, 10)} | {f"p{n}" for n in range(5)}
    assert statuses(requested) == {"pending": 5}
    assert statuses(cancelled) == {"cancelled": 5}
    assert statuses(delayed) == {"queued": 6, "pending": 4}
    assert statuses(plain) == {"queued": 5}

    # Once its not_before has passed, a held item is released.
    with db.session_scope() as session:
        session.execute(
            update(Item)
            .where(Item.batch_id == delayed, Item.custom_id == "d3")
            .values(not_before=func.now() - text("interval '1 second'"))
        )
    assert {custom_id for _, custom_id in release(settings)} == {"d3"}
    assert statuses(requested) == {"pending": 5}


def test_a_release_is_published_in_the_fair_order_not_by_id(dispatch_ahead):
    """The released items come back (and are published, and consumed) interleaved in
    the fair order: with equal weights, a tenant that submitted later is not put behind
    the earlier one's items in every round (its items would wait longer for a slot
    while counting in its share)."""
    settings = dispatch_ahead(2.0)
    make_tenant("early")
    make_tenant("late")
    submit("early", "e", 100)
    submit("late", "l", 100)
    with db.session_scope() as session:
        released = release_model(session, spec(), settings)
        owners = dict(
            session.execute(
                select(Item.id, Tenant.name)
                .join(Tenant, Tenant.id == Item.tenant_id)
                .where(Item.id.in_([r.item_id for r in released]))
            ).all()
        )
    order = [owners[r.item_id] for r in released]
    assert len(order) == window(settings) and Counter(order) == {
        "early": len(order) // 2,
        "late": len(order) // 2,
    }
    # In the fair order each half of the round holds about half of each tenant's items;
    # in id order the first half would be all "early".
    first_half = Counter(order[: len(order) // 2])
    assert abs(first_half["early"] - first_half["late"]) <= 2, order


def test_the_broker_delivers_a_release_in_the_fair_order(dispatch_ahead):
    """What :func:`batchgen.worker.dispatch.dispatch` publishes (one producer, one Redis
    pipeline) reaches the model's queue whole, and a worker takes it in the fair order."""
    import base64
    import json

    import redis

    from batchgen.worker.dispatch import dispatch

    settings = dispatch_ahead(2.0)
    make_tenant("first")
    make_tenant("second")
    submit("first", "f", 50)
    submit("second", "s", 50)
    queue = spec().queue
    broker = redis.Redis.from_url(settings.broker_url)
    broker.delete(queue)
    released = dispatch(get_registry(), settings, [MODEL])
    assert released == window(settings)
    # kombu pushes on the left and a worker pops from the right: oldest first.
    delivered = [
        json.loads(base64.b64decode(json.loads(raw)["body"]))
        for raw in reversed(broker.lrange(queue, 0, -1))
    ]
    assert len(delivered) == released
    with db.session_scope() as session:
        rows = session.execute(
            select(Item.id, Tenant.name).join(Tenant, Tenant.id == Item.tenant_id)
        ).all()
    owner = {item_id: name for item_id, name in rows}
    order = [owner[args[0]] for args, _, _ in delivered]
    assert all(kwargs["ticket"]["attempt"] == 1 for _, kwargs, _ in delivered)
    first_half = Counter(order[: released // 2])
    assert abs(first_half["first"] - first_half["second"]) <= 2, order
