"""The fast tier: the worker path's decisions against one real Redis (the Lua scripts
that make them), started once per session: each test takes milliseconds, with no
PostgreSQL, worker process or provider simulator."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis


@pytest.fixture(scope="session")
def session_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    """A redis-server of this session's own (the embedded one's binary, nothing on disk)."""
    from batchgen.embedded import RedisServer, free_port

    folder: Path = tmp_path_factory.mktemp("fast") / "redis"
    server = RedisServer(free_port(), folder).start()
    client = redis.Redis.from_url(server.url)
    try:
        yield client
    finally:
        client.close()
        server.stop()


@pytest.fixture
def fast_redis(session_redis: redis.Redis) -> redis.Redis:
    """The session's Redis, emptied before the test."""
    session_redis.flushdb()
    return session_redis
