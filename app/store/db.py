"""Engine and session factory (one pool per process), and running migrations."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources

import psycopg
from sqlalchemy import Engine, create_engine, exc
from sqlalchemy.orm import Session, sessionmaker

from batchgen.config import get_settings

# Read through the import system: the folder is migrations/ on disk, batchgen.migrations installed.
MIGRATIONS_DIR = str(resources.files("batchgen.migrations"))
# First key of the advisory locks this project takes (ASCII "BGDP"): + 0 a model's
# dispatch (store.items.release), + 1 a model's admission, + 2 a tenant's (store.quotas).
ADVISORY_NAMESPACE = 0x42474450
# A connect that gets no answer (a host gone, a partition) fails after this long.
CONNECT_TIMEOUT_S = 10

# Errors that say "the database could not be reached or dropped us", not "this
# statement is wrong": worth retrying the same transaction. Pool time-outs
# (every connection busy or none could be made) count as such.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    exc.OperationalError,
    exc.InterfaceError,
    exc.TimeoutError,
    psycopg.OperationalError,
    psycopg.InterfaceError,
)


def is_transient(error: BaseException) -> bool:
    """True for a database error that a retry of the whole transaction may cure."""
    if isinstance(error, TRANSIENT_ERRORS):
        return True
    return isinstance(error, exc.DBAPIError) and error.connection_invalidated


@functools.cache
def _engine_for(url: str) -> Engine:
    return create_engine(
        url,
        pool_size=10,
        max_overflow=20,
        # A terminated backend (failover, restart) is detected before use.
        pool_pre_ping=True,
        # Bound parameters hold prompts: never put them in error messages or logs.
        hide_parameters=True,
        pool_recycle=1800,
        connect_args={"connect_timeout": CONNECT_TIMEOUT_S},
    )


def get_engine(url: str | None = None) -> Engine:
    """The process's engine for ``url`` (default: the settings' database)."""
    return _engine_for(url or get_settings().sqlalchemy_url)


@functools.cache
def _factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str | None = None) -> Iterator[Session]:
    """A session in one transaction: committed on success, rolled back on error."""
    session = _factory(url or get_settings().sqlalchemy_url)()
    try:
        with session.begin():
            yield session
    finally:
        session.close()


def alembic_config(url: str | None = None):  # type: ignore[no-untyped-def]
    """An Alembic config pointing at migrations/ and the given database."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", MIGRATIONS_DIR)
    cfg.set_main_option("sqlalchemy.url", (url or get_settings().sqlalchemy_url).replace("%", "%%"))
    return cfg


def upgrade(url: str | None = None, revision: str = "head") -> None:
    """Apply migrations up to ``revision``."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)
