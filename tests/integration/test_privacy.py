"""Invariant 7: Celery messages carry ids only, never prompt text."""

from __future__ import annotations

import base64
import json

import pytest
import redis

from batchgen import python_api as client
from batchgen.config import get_settings
from batchgen.registry import get_registry
from tests.helpers import chat_line, make_tenant

pytestmark = pytest.mark.integration

SECRET = "Top secret launch of the Zorblax 9000 hover-kettle"


def test_broker_messages_carry_ids_only(clean_db):
    from batchgen.tasks.dispatch import dispatch_now

    make_tenant("private")
    client.submit_batch(
        [chat_line(f"p{i}", text=f"{SECRET} #{i}") for i in range(5)], tenant="private"
    )
    assert dispatch_now() == 5  # no worker runs: the messages stay in the broker

    r = redis.Redis.from_url(get_settings().redis.url)
    queue = get_registry()["sim-small"].queue
    raw_messages = r.lrange(queue, 0, -1)
    carried: list[int] = []
    for raw in raw_messages:
        assert SECRET.encode() not in raw
        envelope = json.loads(raw)
        body = base64.b64decode(envelope["body"])
        assert SECRET.encode() not in body
        args, kwargs, _ = json.loads(body)
        assert len(args) == 1 and isinstance(args[0], int)
        # The model (routing), the ticket and a pack's other items with theirs: the
        # batch id and the tenant's name, then numbers only.
        assert set(kwargs) <= {"model", "ticket", "more"} and kwargs["model"] == "sim-small"
        tickets = [(args[0], kwargs["ticket"])] + [tuple(e) for e in kwargs.get("more") or ()]
        for item_id, ticket in tickets:
            assert isinstance(item_id, int)
            carried.append(item_id)
            assert ticket.pop("batch").startswith("batch_")
            assert ticket.pop("tenant_name") == "private"
            assert ticket.pop("tenant_tokens_per_min") is None
            assert set(ticket) == {"tenant", "attempt", "prompt_tokens_est", "max_tokens"}
            assert all(isinstance(v, int) for v in ticket.values())
            assert ticket["attempt"] == 1
        assert envelope["headers"]["task"] == "batchgen.generate"
    assert sorted(carried) == sorted(set(carried)) and len(carried) == 5  # each item once
    # and the control queue's wake-up message carries nothing at all
    for raw in r.lrange("batchgen.control", 0, -1):
        assert SECRET.encode() not in raw


def test_each_model_group_gets_only_its_own_messages(clean_db):
    """Custom rate-limit routing: a message lands in its group's queue and nowhere else,
    also once workers have declared every queue (as they do at start)."""
    from batchgen.tasks.celery_app import celery_app
    from batchgen.tasks.dispatch import dispatch_now

    with celery_app.connection_for_write() as conn:
        for queue in celery_app.amqp.queues.values():
            queue(conn.default_channel).declare()
    make_tenant("router")
    rows = [chat_line(f"r{i}", model="sim-small" if i % 3 else "sim-large") for i in range(9)]
    client.submit_batch(rows, tenant="router")
    assert dispatch_now() == 9

    r = redis.Redis.from_url(get_settings().redis.url)

    def items_in(queue: str) -> list[tuple[str, str]]:
        """(task, model) of each item its messages carry (a pack's, too)."""
        carried = []
        for raw in r.lrange(queue, 0, -1):
            envelope = json.loads(raw)
            _, kwargs, _ = json.loads(base64.b64decode(envelope["body"]))
            task = (envelope["headers"]["task"], kwargs["model"])
            carried += [task] * (1 + len(kwargs.get("more") or ()))
        return carried

    assert items_in("llm.sim") == [("batchgen.generate", "sim-small")] * 6
    assert items_in("llm.sim-large") == [("batchgen.generate", "sim-large")] * 3
    control = [json.loads(raw)["headers"]["task"] for raw in r.lrange("batchgen.control", 0, -1)]
    assert control == ["batchgen.dispatch"]  # the wake-up after submit
