"""Prompt-cache-aware release order: in a dispatch round, a tenant's picks of one
priority that share a cached prompt prefix are released together (real PostgreSQL, the
dispatcher's own round; no worker)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from batchgen import python_api
from batchgen.config import Settings, get_settings
from batchgen.registry import get_registry
from batchgen.store import db
from batchgen.store.schema import Item
from batchgen.worker.dispatch import release_model
from tests.helpers import chat_line, make_tenant

MODEL = "sim-small"  # max_concurrency 16: a round of 16 places at an ahead factor of 1
GUIDE = "Write in the brand's calm voice; name the material; never promise delivery. " * 90


@pytest.fixture
def one_window(clean_db) -> Iterator[Settings]:
    name = "BATCHGEN_DISPATCH_AHEAD_FACTOR"
    saved = os.environ.get(name)
    os.environ[name] = "1.0"
    get_settings.cache_clear()
    yield get_settings()
    if saved is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = saved
    get_settings.cache_clear()


def submit(prefix: str, n: int, system: str | None, priority: str) -> None:
    rows = [chat_line(f"{prefix}{i}", model=MODEL, max_tokens=5) for i in range(n)]
    if system is not None:
        for row in rows:
            row["body"]["messages"].insert(0, {"role": "system", "content": system})
    python_api.submit_batch(rows, tenant="shop", priority=priority)


def test_a_tenants_picks_that_share_a_prefix_are_released_together(one_window):
    make_tenant("shop")
    # Interactive: i shares guide A, j has no prefix. Bulk: a (guide A), b (guide B),
    # c (none). The store's order takes a priority's batches in turn: i0 j0 i1 j1, then
    # a0 b0 c0 a1 b1 c1 ...
    submit("i", 2, GUIDE + "A", "interactive")
    submit("j", 2, None, "interactive")
    submit("a", 10, GUIDE + "A", "bulk")
    submit("b", 10, GUIDE + "B", "bulk")
    submit("c", 10, None, "bulk")
    with db.session_scope() as session:
        keys = dict(session.execute(select(Item.custom_id, Item.prefix_key)).all())
        released = release_model(session, get_registry()[MODEL], one_window)
        ids = [t.item_id for t in released]
        names = dict(session.execute(select(Item.id, Item.custom_id)).all())
    assert keys["i0"] == keys["a0"] != keys["b0"] and keys["j0"] is None and keys["c0"] is None
    order = [names[i] for i in ids]
    # The same 16 items a round of turns takes, a prefix's together within a priority;
    # items of no prefix keep their places among them.
    assert order == ["i0", "i1", "j0", "j1"] + [f"{b}{n}" for b in "abc" for n in range(4)]
