"""The sweep and a synchronous call whose caller is gone (its API process died): it
cancels the attempt it saw the caller's process run, never one begun since."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import func, select, update

from batchgen.config import get_settings
from batchgen.domain.formats.endpoints import CHAT_COMPLETIONS
from batchgen.registry import get_registry
from batchgen.store import call_rows, db, items
from batchgen.store.schema import Item
from batchgen.store.tenants import find
from tests.helpers import make_tenant

pytestmark = pytest.mark.integration


def _running_call(attempts: int) -> int:
    """A stored call whose item runs its attempt ``attempts``, its lease still live."""
    make_tenant("gone")
    line = {
        "custom_id": "call",
        "method": "POST",
        "url": CHAT_COMPLETIONS,
        "body": {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]},
    }
    with db.session_scope() as s:
        stored = call_rows.store_call(
            s,
            find(s, "gone"),
            line,
            deadline_s=60,
            endpoint=CHAT_COMPLETIONS,
            registry=get_registry(),
            settings=get_settings(),
        )
        s.execute(
            update(Item)
            .where(Item.id == stored.item_id)
            .values(
                status="running",
                attempts=attempts,
                sent_at=func.now(),
                lease_expires_at=func.now() + dt.timedelta(seconds=60),
            )
        )
    return stored.item_id


def _sweep(gone: dict[int, int]) -> tuple[list[items.LostAttempt], str]:
    with db.session_scope() as s:
        lost = items.sweep_lost(s, 5, {}, callers_gone=gone)
    with db.session_scope() as s:
        status = s.scalar(select(Item.status).where(Item.id.in_(gone)))
    return lost, str(status)


def test_an_attempt_begun_after_the_look_is_not_cancelled(clean_db):
    """The sweep saw attempt 1 run by the dead caller's process; a worker has claimed
    attempt 2 since: that attempt runs on."""
    item_id = _running_call(attempts=2)
    lost, status = _sweep({item_id: 1})
    assert (lost, status) == ([], "running")


def test_the_attempt_seen_is_cancelled(clean_db):
    item_id = _running_call(attempts=2)
    lost, status = _sweep({item_id: 2})
    assert [(a.item_id, a.attempts) for a in lost] == [(item_id, 2)]
    assert status == "cancelled"
