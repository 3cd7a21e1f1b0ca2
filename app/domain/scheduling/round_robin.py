"""Deficit round robin: which tenants get a model's free places in a dispatch round (pure).

The tenants with ready work on a model form a ring, in tenant-id order. A tenant's
turn grants it a quantum of ``weight`` items (its deficit); it takes them while the
round has places, and the turn passes to the next tenant in the ring. A round ends
when its places run out, possibly in the middle of a turn: the ring's position and
what is left of that tenant's deficit (:class:`Turn`) are carried to the next round,
which goes on from there. So the rounds together release what one long round would
have (:func:`plan_round` is invariant under splitting a round), and over rounds each
tenant with work gets releases in proportion to its weight however few places a round
has: a round of 16 places among 500 tenants serves the next 16 of them, and the one
after it the 16 after those.

A tenant whose ready work runs out ends its turn and loses what was left of its
deficit (:meth:`Plan.next_turn`): an idle tenant saves no credit, and a tenant that
comes back joins the ring where it stands.

A tenant held back by its own budget (its ``tokens_per_min``, known from the last of its
items the budget turned away, until when it frees) is passed over as if it had no
ready work: it takes no place another tenant could use, and keeps no deficit. Once its
budget frees it is in the ring again where it stands, so it is not starved.

A round reads only the tenants it serves: with ``places`` free places, no tenant past
the first ``places`` of the ring (from its position) can be reached, since each turn
grants at least one item. The store reads that many tenants of the ring, or the
whole ring when it is shorter, and then the items of the tenants served
(:mod:`batchgen.store.rounds`); the cost of a round does not grow with the number of
tenants, busy or idle.

Within a tenant's share, the store picks the tenant's items (interactive before bulk,
its open batches of one priority sharing: :mod:`batchgen.store.rounds`), and
:func:`order_picks` orders them: the picks that share a cached prompt prefix go
together, so the provider finds the prefix it has just cached.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# Items a turn grants per unit of weight.
QUANTUM_ITEMS = 1
# Reads of the ring in one round at most: a tenant served fewer items than planned (its
# ready work ran out) leaves places that the next tenants take in another pass; the
# places still free after the last pass wait for the next round.
MAX_PASSES = 4


@dataclass(frozen=True)
class Member:
    """A tenant with ready work on the model, and its weight (>= 1)."""

    tenant_id: int
    weight: int


@dataclass(frozen=True)
class Turn:
    """Where the ring stands between rounds: the next round starts at the first tenant
    whose id is ``start`` or more (wrapping round to the lowest id); if that is tenant
    ``start`` itself, ``left`` items of its current turn remain (its deficit) before it
    is granted a new quantum."""

    start: int = 0
    left: int = 0


def quantum(weight: int) -> int:
    """The items one turn grants a tenant of ``weight``."""
    return max(1, weight) * QUANTUM_ITEMS


def ring_order(tenant_ids: Iterable[int], start: int) -> list[int]:
    """``tenant_ids`` in ring order from ``start``: the ids from ``start`` up, then the
    ones below it."""
    ids = sorted(set(tenant_ids))
    return [t for t in ids if t >= start] + [t for t in ids if t < start]


@dataclass(frozen=True)
class Plan:
    """A round's places, each the tenant it goes to (in release order), and where the
    ring stands after it."""

    places: tuple[int, ...]
    turn: Turn

    def takes(self) -> dict[int, int]:
        """Items per tenant, in the order the tenants are first served."""
        return dict(Counter(self.places))

    def next_turn(self, got: Mapping[int, int]) -> Turn:
        """Where the ring stands once each tenant took ``got[tenant]`` of its places: a
        tenant that took fewer than planned ran out of ready work, so a turn left open
        in its name ends (it keeps no deficit)."""
        short = self.short(got)
        if self.turn.left > 0 and self.turn.start in short:
            return Turn(self.turn.start + 1, 0)
        return self.turn

    def short(self, got: Mapping[int, int]) -> set[int]:
        """The tenants that took fewer items than planned (their ready work ran out)."""
        return {t for t, n in self.takes().items() if got.get(t, 0) < n}


def plan_round(ring: Sequence[Member], turn: Turn, places: int, *, whole: bool) -> Plan:
    """Give ``places`` places to the tenants of ``ring`` by deficit round robin.

    ``ring``: tenants with ready work, in ring order from ``turn.start``
    (:func:`ring_order`). ``whole``: it is every such tenant, so the round may go round
    it more than once; otherwise it must hold at least ``places`` tenants (a round
    never gets further). An empty ring gets nothing, and the turn stays where it was.
    """
    if places <= 0 or not ring:
        return Plan((), turn)
    if not whole and len(ring) < places:
        raise ValueError(f"a part of the ring of {len(ring)} tenants for {places} places")
    given: list[int] = []
    visit = 0
    while True:
        member = ring[visit % len(ring)]
        carried = visit == 0 and member.tenant_id == turn.start and turn.left > 0
        deficit = turn.left if carried else quantum(member.weight)
        take = min(deficit, places - len(given))
        given.extend([member.tenant_id] * take)
        if len(given) == places:
            left = deficit - take
            after = Turn(member.tenant_id, left) if left else Turn(member.tenant_id + 1, 0)
            return Plan(tuple(given), after)
        visit += 1


# read_ring(start, limit): up to ``limit`` tenants with ready work in ring order from
# ``start``, and whether that is all of them.
RingReader = Callable[[int, int], tuple[list[Member], bool]]
# group(pick): what a pick shares with others that should run together (None: nothing).
Group = Callable[[T], Hashable | None]


def run_round(
    read_ring: RingReader,
    take: Callable[[dict[int, int]], Mapping[int, list[T]]],
    turn: Turn,
    places: int,
    max_passes: int = MAX_PASSES,
    group: Group[T] | None = None,
    held: Collection[int] = frozenset(),
) -> tuple[list[T], Turn]:
    """One dispatch round: plan, take each tenant's items (``take({tenant: n})`` returns
    up to ``n`` picks of each, in the tenant's order), and give the places of tenants
    that ran out of ready work to the next ones. Tenants in ``held`` (held back by their
    own budget now) get no place. Returns the picks in release order (:func:`interleave`,
    each tenant's picks :func:`order_picks` by ``group``) and where the ring stands for
    the next round."""
    released: list[T] = []
    # Passed over: the held tenants, and those that ran dry in an earlier pass. Reading
    # as many more tenants as there are of them leaves enough for the places.
    skip: set[int] = set(held)
    for _ in range(max_passes):
        if places <= 0:
            break
        members, whole = read_ring(turn.start, places + len(skip))
        ring = [m for m in members if m.tenant_id not in skip]
        if not whole:
            ring = ring[:places]
        plan = plan_round(ring, turn, places, whole=whole)
        if not plan.places:
            break
        picks = take(plan.takes())
        got = {tenant: len(p) for tenant, p in picks.items()}
        released.extend(interleave(plan.places, picks, group))
        places -= sum(got.values())
        turn = plan.next_turn(got)
        short = plan.short(got)
        if not short:
            break
        skip |= short
    return released, turn


def order_picks(picks: list[T], group: Group[T] | None = None) -> list[T]:
    """The order in which one tenant's picks fill its places in a round: the store's
    order (interactive first, then the tenant's open batches of a priority in turn),
    except that the picks of one ``group`` (those sharing a cached prompt prefix) go
    together, where the first of them was. Picks of no group keep their places among
    the groups. It changes who runs first, never how many."""
    if group is None:
        return picks
    first: dict[Hashable, int] = {}
    at: list[int] = []  # each pick's place: its own, or its group's first pick's
    for index, pick in enumerate(picks):
        key = group(pick)
        at.append(index if key is None else first.setdefault(key, index))
    return [picks[i] for i in sorted(range(len(picks)), key=lambda i: (at[i], i))]


def interleave(
    places: Sequence[int], picks: Mapping[int, list[T]], group: Group[T] | None = None
) -> list[T]:
    """The round's release order: each place takes the next of its tenant's picks
    (:func:`order_picks`); places whose tenant has no pick left stay empty."""
    queues: dict[int, Iterator[T]] = {
        tenant: iter(order_picks(list(p), group)) for tenant, p in picks.items()
    }
    ordered: list[T] = []
    for tenant in places:
        for pick in queues.get(tenant, ()):
            ordered.append(pick)
            break
    return ordered


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index of ``values`` (1.0: all equal; 1/n: one takes everything)."""
    xs = list(values)
    square_sum = sum(x * x for x in xs)
    return 1.0 if not xs or square_sum == 0 else sum(xs) ** 2 / (len(xs) * square_sum)
