"""Engine and session factory (one pool per process), and running migrations."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine, create_engine, event, exc
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


# A connection idle longer than this is pinged before use, so a backend terminated
# meanwhile (failover, restart) is found before a statement fails on it. A busy
# connection is not: SQLAlchemy's own pre-ping costs a round trip and a transaction
# at every checkout, as many as the hot path's own. A busy connection whose backend
# died fails its statement; that error invalidates the whole pool, and the worker
# retries the transaction (or the sweep hands the item back).
PING_IF_IDLE_S = 1.0


def _ping_if_idle(engine: Engine) -> None:
    @event.listens_for(engine, "checkin")
    def _checked_in(dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        idle_since = record.info.get("idle_since")
        if idle_since is None or time.monotonic() - idle_since < PING_IF_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as error:
            # The pool replaces the connection and tries the checkout again.
            raise exc.DisconnectionError() from error


@functools.cache
def _engine_for(url: str) -> Engine:
    engine = create_engine(
        url,
        pool_size=10,
        max_overflow=20,
        # Bound parameters hold prompts: never put them in error messages or logs.
        hide_parameters=True,
        pool_recycle=1800,
        connect_args={"connect_timeout": CONNECT_TIMEOUT_S},
    )
    _ping_if_idle(engine)
    return engine


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


@functools.cache
def _autocommit_engine(url: str) -> Engine:
    # The same pool; a connection checked out here runs each statement as its own
    # transaction (psycopg's autocommit: no BEGIN and COMMIT round trips).
    return get_engine(url).execution_options(isolation_level="AUTOCOMMIT")


@contextmanager
def autocommit(url: str | None = None) -> Iterator[Connection]:
    """A connection whose every statement is its own transaction: for the hot path's
    single-statement moves (a claim, marking a call sent), one round trip each."""
    with _autocommit_engine(url or get_settings().sqlalchemy_url).connect() as connection:
        yield connection


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
