"""A synchronous call stored in one statement (``sql/call_store.sql``) is stored as
:func:`batchgen.store.call_rows.store_call` stores it through ``store_batch``: the same
batch, the same item (queued, its lease, its dispatch key), the same admitted totals;
and a call that needs more (a tenant with quotas) is left to ``store_call``."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from batchgen.config import get_settings
from batchgen.domain.formats.endpoints import CHAT_COMPLETIONS
from batchgen.errors import ValidationFailed
from batchgen.registry import get_registry
from batchgen.store import call_rows, db, tenants
from batchgen.store.schema import AdmittedTotals, Batch, Item
from tests.helpers import make_tenant

LINE = {
    "custom_id": "call",
    "method": "POST",
    "url": CHAT_COMPLETIONS,
    "body": {
        "model": "sim-small",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 20,
    },
}
# Columns that differ between any two stored calls.
OWN = {"id", "batch_id", "created_at", "queued_at", "lease_expires_at", "deadline_at"}


def _plain(tenant: Any, line: dict[str, Any] = LINE) -> call_rows.StoredCall | None:
    with db.autocommit() as connection:
        return call_rows.store_plain_call(
            connection,
            tenant,
            line,
            deadline_s=60,
            endpoint=CHAT_COMPLETIONS,
            registry=get_registry(),
            settings=get_settings(),
        )


def _general(name: str) -> call_rows.StoredCall:
    with db.session_scope() as s:
        return call_rows.store_call(
            s,
            tenants.find(s, name),
            LINE,
            deadline_s=60,
            endpoint=CHAT_COMPLETIONS,
            registry=get_registry(),
            settings=get_settings(),
        )


def _rows(stored: call_rows.StoredCall) -> tuple[dict[str, Any], dict[str, Any], float, float]:
    """The call's batch and item columns (its own ids and times left out), and its
    item's seconds to deadline and queued lease."""
    with db.session_scope() as s:
        batch = s.get(Batch, stored.batch_id)
        item = s.get(Item, stored.item_id)
        assert batch is not None and item is not None
        assert item.queued_at is not None and item.lease_expires_at is not None
        lease_s = (item.lease_expires_at - item.queued_at).total_seconds()
        to_deadline_s = (item.deadline_at - batch.created_at).total_seconds()
        columns = {
            c.key: getattr(batch, c.key) for c in Batch.__mapper__.column_attrs if c.key not in OWN
        }
        item_columns = {
            c.key: getattr(item, c.key) for c in Item.__mapper__.column_attrs if c.key not in OWN
        }
    return columns, item_columns, to_deadline_s, lease_s


def test_a_plain_call_is_stored_as_store_call_stores_it(clean_db):
    make_tenant("plain")
    with db.session_scope() as s:
        tenant = tenants.find(s, "plain")
    plain = _plain(tenant)
    assert plain is not None
    general = _general("plain")
    assert plain.model == general.model == "sim-small" and not plain.replayed
    ours, theirs = _rows(plain), _rows(general)
    assert ours[0] == {**theirs[0], "request_sha256": ours[0]["request_sha256"]}
    assert ours[0]["request_sha256"] == theirs[0]["request_sha256"]
    # Keyed from the tenant's dispatch clock: both calls from its start.
    assert ours[1] == theirs[1] and ours[1]["status"] == "queued" and ours[1]["dispatch_key"] == 1
    assert ours[2] == pytest.approx(theirs[2]) == pytest.approx(60.0)  # the call's deadline
    assert (
        ours[3] == pytest.approx(theirs[3]) == pytest.approx(get_settings().worker.queued_lease_s)
    )
    assert plain.queue_ticket is not None and general.queue_ticket is not None
    assert plain.queue_ticket.item_id == plain.item_id
    assert {
        **plain.queue_ticket.__dict__,
        "item_id": 0,
        "batch_id": "",
    } == {**general.queue_ticket.__dict__, "item_id": 0, "batch_id": ""}
    with db.session_scope() as s:
        totals = s.scalars(select(AdmittedTotals)).one()
        assert (totals.items, totals.tokens_est) == (
            2,
            2 * (general.queue_ticket.max_tokens + general.queue_ticket.prompt_tokens_est),
        )


def test_a_tenant_with_quotas_is_left_to_store_call(clean_db):
    make_tenant("capped", max_pending_items=5)
    with db.session_scope() as s:
        tenant = tenants.find(s, "capped")
    assert _plain(tenant) is None
    with db.session_scope() as s:
        assert s.scalars(select(Batch.id)).all() == []


def test_a_bad_call_is_refused_before_anything_is_stored(clean_db):
    make_tenant("bad")
    with db.session_scope() as s:
        tenant = tenants.find(s, "bad")
    line = {**LINE, "body": {**LINE["body"], "max_tokens": -1}}
    with pytest.raises(ValidationFailed):
        _plain(tenant, line)
    with db.session_scope() as s:
        assert s.scalars(select(Batch.id)).all() == []
