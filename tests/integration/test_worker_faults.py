"""The worker under faults around one provider call: what is billed, what is kept.

Real PostgreSQL, Redis and the simulator over HTTP; one delivery is run in this
process with :func:`app.execution.run_item` where the test needs to look at a
single call, and in worker processes where a worker must die.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select

from app import client, db, keys
from app.config import Settings, get_settings
from app.execution import run_item
from app.gate import Gate
from app.redis_client import get_redis
from app.registry import Registry, parse_registry
from app.scheduling import release_all
from app.schema import Item, TenantDailyUsage, UsageLedger
from tests.helpers import chat_line, make_tenant

pytestmark = pytest.mark.integration

MODEL_OF_KIND = {"openai": "sim-small", "anthropic": "sim-claude"}


def _registry() -> Registry:
    """The shipped registry, pointing at this module's simulator (read now, not cached)."""
    path = Path(get_settings().models_file)
    return parse_registry(path.read_text(encoding="utf-8"), str(path))


def _queue_one(registry: Registry, model: str, tenant: str, **line: object) -> int:
    """Submit one request and move it to ``queued``, as the dispatcher would; its id."""
    make_tenant(tenant)
    client.submit_batch([chat_line("only", model=model, **line)], tenant=tenant)
    with db.session_scope() as s:
        released = release_all(s, registry, get_settings())
    assert len(released) == 1
    return released[0].item_id


def _count(table: type, *where: object) -> int:
    with db.session_scope() as s:
        return int(s.scalar(select(func.count()).select_from(table).where(*where)) or 0)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_refused_connection_is_not_billed(clean_db, simulator, kind, stream):
    """The provider's port refuses the TCP connection: nothing left the machine, so
    nothing is ledgered or counted, and the token reservation and the slot are freed."""
    registry = _registry()
    spec = registry[MODEL_OF_KIND[kind]]
    settings: Settings = get_settings().model_copy(update={"stream_calls": stream})
    item_id = _queue_one(registry, spec.name, f"refused-{kind}-{stream}")
    gate = Gate(get_redis(), settings)

    with simulator.refusing_connections():
        verdict = run_item(item_id, registry, settings, gate)

    assert verdict.outcome == "retry"  # a transient failure, retried later
    assert _count(UsageLedger) == 0
    assert _count(TenantDailyUsage) == 0
    assert gate.budget.used(spec) == (0, 0)  # the reservation was given back
    assert get_redis().zcard(keys.slots(spec.name)) == 0
    with db.session_scope() as s:
        item = s.get(Item, item_id)
        assert item is not None
        assert (item.status, item.error_code, item.sent_at) == ("pending", "transient", None)
