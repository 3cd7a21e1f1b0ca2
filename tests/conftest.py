"""Real servers for the tests.

With ``DATABASE_URL`` / ``REDIS_URL`` set, the tests use those servers but a
database of their own (``batchgen_test_<pid>``, dropped at the end) and Redis
database 15. Without them, they start embedded PostgreSQL and Redis.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

TEST_REDIS_DB = 15


def _redis_test_url(url: str) -> str:
    """The same Redis server, database 15, so the shared database 0 is left alone."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{TEST_REDIS_DB}"))


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """DATABASE_URL and REDIS_URL of migrated, empty, real servers."""
    from app import db, embedded
    from app.config import get_settings

    base = tmp_path_factory.mktemp("services")
    postgres = None if os.environ.get("DATABASE_URL") else embedded.start_postgres(base / "pg")
    server_url = os.environ.get("DATABASE_URL") or str(postgres.get_uri())
    name = f"batchgen_test_{os.getpid()}"
    embedded.drop_database(server_url, name)
    db_url = embedded.ensure_database(server_url, name)
    redis_server = None
    if os.environ.get("REDIS_URL"):
        redis_url = _redis_test_url(os.environ["REDIS_URL"])
    else:
        redis_server = embedded.RedisServer(embedded.free_port(), base / "redis").start()
        redis_url = redis_server.url
    saved = {k: os.environ.get(k) for k in ("DATABASE_URL", "REDIS_URL")}
    os.environ["DATABASE_URL"] = db_url
    os.environ["REDIS_URL"] = redis_url
    get_settings.cache_clear()
    db.upgrade()
    try:
        yield {"DATABASE_URL": db_url, "REDIS_URL": redis_url, "server_url": server_url}
    finally:
        db.get_engine().dispose()
        embedded.drop_database(server_url, name)
        if redis_server:
            redis_server.stop()
        if postgres is not None:
            embedded.stop_postgres(postgres)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        get_settings.cache_clear()


@pytest.fixture
def clean_db(services: dict[str, str]) -> dict[str, str]:
    """Empty tables and an empty Redis database before the test."""
    import redis
    from sqlalchemy import text

    from app.db import get_engine

    with get_engine().begin() as conn:
        conn.execute(
            text(
                "TRUNCATE tenant_daily_usage, usage_ledger, results, items, batches, tenants "
                "RESTART IDENTITY CASCADE"
            )
        )
    redis.Redis.from_url(services["REDIS_URL"]).flushdb()
    return services


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
