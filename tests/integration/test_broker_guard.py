"""The Redis transport's restore of unacknowledged messages after the broker
connection was collected (issue #27 item 10; app/worker/broker_guard.py).

On a lost broker, Celery collects the connection (its transport's client becomes
None) and then closes the channels still around; closing one drops its pool and
restores its unacknowledged messages, which built a new pool from the collected
connection: ``AttributeError: 'NoneType' object has no attribute 'hostname'`` ended
the worker. Real Redis, a real kombu connection, channel and delivery.
"""

from __future__ import annotations

import uuid

import pytest
import redis
from kombu import Connection

from batchgen.worker import broker_guard

pytestmark = pytest.mark.integration


def test_a_collected_connection_restores_nothing_and_raises_nothing(services):
    broker_guard.install()
    broker_guard.install()  # once per process, however often it is called
    queue_name = f"guard-{uuid.uuid4().hex[:8]}"
    with Connection(services["REDIS_URL"]) as connection:
        channel = connection.channel()
        queue = connection.SimpleQueue(queue_name, channel=channel)
        queue.put({"item": 1})
        tag = queue.get(timeout=5).delivery_tag  # delivered, not acknowledged
        assert len(channel.qos._delivered) == 1
        # What Celery's consumer does at a lost broker connection, then a channel close:
        channel._disconnect_pools()
        connection.transport.client = None
        assert broker_guard.connection_collected(channel)

        channel.qos.restore_unacked()  # raised AttributeError ('hostname') unguarded

        assert not channel.qos._delivered
    # The message is still Redis's, for the transport's visibility time-out to restore.
    client = redis.Redis.from_url(services["REDIS_URL"])
    assert client.hexists("unacked", tag)
    client.hdel("unacked", tag)
    client.zrem("unacked_index", tag)
    client.delete(queue_name)


def test_other_attribute_errors_still_raise(services, monkeypatch):
    """Only a collected connection is excused: the guard hides no other bug."""
    from kombu.transport import redis as redis_transport

    broker_guard.install()
    with Connection(services["REDIS_URL"]) as connection:
        channel = connection.channel()
        qos = channel.qos
        qos._delivered["tag"] = object()

        def broken(self, tag, client=None, leftmost=False):  # type: ignore[no-untyped-def]
            raise AttributeError("a bug")

        monkeypatch.setattr(redis_transport.QoS, "restore_by_tag", broken)
        with pytest.raises(AttributeError, match="a bug"):
            qos.restore_unacked()
        qos._delivered.clear()


@pytest.mark.parametrize("settle", ["ack", "reject"])
def test_a_message_settled_after_its_connection_was_collected_raises_nothing(services, settle):
    """A task that ended while the broker was away is acknowledged later, from the event
    loop, on its dead channel: ``AttributeError: 'NoneType' object has no attribute
    'client'`` ended the worker. Dropped now; the message stays Redis's."""
    broker_guard.install()
    queue_name = f"guard-{uuid.uuid4().hex[:8]}"
    with Connection(services["REDIS_URL"]) as connection:
        channel = connection.channel()
        queue = connection.SimpleQueue(queue_name, channel=channel)
        queue.put({"item": 1})
        message = queue.get(timeout=5)
        tag = message.delivery_tag
        channel._disconnect_pools()
        connection.transport.client = None
        channel.connection = None  # as a closed channel has it
        assert broker_guard.connection_collected(channel)

        getattr(message, settle)()  # raised AttributeError ('client') unguarded

        assert tag not in channel.qos._delivered
    client = redis.Redis.from_url(services["REDIS_URL"])
    assert client.hexists("unacked", tag)
    client.hdel("unacked", tag)
    client.zrem("unacked_index", tag)
    client.delete(queue_name)


def test_an_acknowledgement_that_fails_in_redis_frees_its_prefetch_place(tmp_path):
    """The broker is killed before the consumer sees it go: every acknowledgement fails
    in Redis. Each still raises, and each delivery leaves the prefetch count, so the
    consumer asks the broker again (and then sees it is lost) instead of waiting for
    room that never comes."""
    from batchgen import embedded

    broker_guard.install()
    server = embedded.RedisServer(embedded.free_port(), tmp_path / "redis").start()
    try:
        with Connection(server.url) as connection:
            channel = connection.channel()
            channel.basic_qos(prefetch_count=1)
            queue = connection.SimpleQueue(f"guard-{uuid.uuid4().hex[:8]}", channel=channel)
            queue.put({"item": 1})
            message = queue.get(timeout=5)
            assert not channel.qos.can_consume()  # the one place is taken
            server.stop()

            with pytest.raises(redis.RedisError):
                message.ack()

            assert message.delivery_tag not in channel.qos._delivered
            assert channel.qos.can_consume()
    finally:
        server.stop()
