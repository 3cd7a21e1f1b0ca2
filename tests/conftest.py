"""Real servers for the tests.

With ``DATABASE_URL`` / ``REDIS_URL`` set, the tests use those servers but a
database of their own (``batchgen_test_<pid>``, dropped at the end) and Redis
database 15. Without them, they start embedded PostgreSQL and Redis.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

TEST_REDIS_DB = 15
# The folders' names on disk. Installed, they are batchgen, batchgen.tasks,
# batchgen.migrations and batchgen.celeryconfig; a module loaded under one of these
# names (the repo root is on sys.path) would be a second copy of ours.
OLD_NAMES = ("app", "tasks", "celeryconfig", "migrations")


def modules_under_old_names() -> list[str]:
    return sorted(
        name
        for name in sys.modules
        if name in OLD_NAMES or name.startswith(tuple(f"{old}." for old in OLD_NAMES))
    )


@pytest.fixture(scope="session", autouse=True)
def _no_module_under_an_old_name() -> Iterator[None]:
    """Fails the run if anything imported ``app``, ``tasks``, ``celeryconfig`` or
    ``migrations`` (or below) instead of the ``batchgen`` names."""
    yield
    loaded = modules_under_old_names()
    assert not loaded, f"modules loaded under their on-disk names: {loaded}"


def _redis_test_url(url: str) -> str:
    """The same Redis server, database 15, so the shared database 0 is left alone."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{TEST_REDIS_DB}"))


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """DATABASE_URL and REDIS_URL of migrated, empty, real servers."""
    from batchgen import embedded
    from batchgen.store import db

    with contextlib.ExitStack() as stack:
        if os.environ.get("DATABASE_URL"):
            server_url = os.environ["DATABASE_URL"]
        else:
            # Its data stays out of pytest's temporary root, which every other pytest
            # run on the machine locks again (mode 0700) when it starts.
            server_url = str(stack.enter_context(embedded.private_postgres()).get_uri())
        if os.environ.get("REDIS_URL"):
            redis_url = _redis_test_url(os.environ["REDIS_URL"])
        else:
            folder = tmp_path_factory.mktemp("services") / "redis"
            redis_server = embedded.RedisServer(embedded.free_port(), folder).start()
            stack.callback(redis_server.stop)
            redis_url = redis_server.url
        name = f"batchgen_test_{os.getpid()}"
        embedded.drop_database(server_url, name)
        db_url = embedded.ensure_database(server_url, name)
        stack.callback(embedded.drop_database, server_url, name)
        stack.enter_context(_environment(DATABASE_URL=db_url, REDIS_URL=redis_url))
        stack.callback(lambda: db.get_engine().dispose())
        db.upgrade()
        yield {"DATABASE_URL": db_url, "REDIS_URL": redis_url, "server_url": server_url}


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set environment variables (and fresh settings) for the block, then put them back."""
    from batchgen.config import get_settings

    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    get_settings.cache_clear()
    try:
        yield
    finally:
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

    from batchgen.store.db import get_engine

    with get_engine().begin() as conn:
        conn.execute(
            text(
                "TRUNCATE tenant_daily_usage, usage_ledger, results, provider_job_items, items, "
                "batch_notifications, "
                "provider_jobs, batches, files, admitted_totals, finished_totals, "
                "batch_totals, latency_totals, dispatch_ring, dispatch_clocks, "
                "tenants RESTART IDENTITY CASCADE"
            )
        )
        conn.execute(text("UPDATE totals_watermark SET rolled_up_before = NULL"))
    redis.Redis.from_url(services["REDIS_URL"]).flushdb()
    return services


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
