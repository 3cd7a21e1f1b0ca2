"""Engine and session factory (one pool per process), and running migrations.

The connection budget of a process (docs/operations.md, "Connections"): its pool to
``DATABASE_URL`` opens at most ``Settings.db_pool_bound`` connections
(``BATCHGEN_DB_POOL_SIZE`` + ``BATCHGEN_DB_MAX_OVERFLOW``), whatever its thread
count; besides, straight to PostgreSQL (``BATCHGEN_DATABASE_DIRECT_URL``, else
``DATABASE_URL``), a process running the offload tick holds up to
:data:`DIRECT_POOL_BOUND` for its session advisory lock, and a process answering
synchronous calls one ``LISTEN`` connection (:mod:`batchgen.store.call_rows`).

Everything that goes through ``DATABASE_URL`` works behind a transaction pooler
(PgBouncer, ``pool_mode = transaction``): no server-side prepared statements
(``BATCHGEN_DB_PREPARED_STATEMENTS`` off, as it is when a direct URL is set), no
session state (no ``SET``, no temporary tables; the advisory locks taken there are
transaction-level ones).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib import resources
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import Connection, Engine, create_engine, event, exc, text
from sqlalchemy.orm import Session, sessionmaker

from batchgen.config import Settings, current_scope, get_settings

# Read through the import system: the folder is migrations/ on disk, batchgen.migrations installed.
MIGRATIONS_DIR = str(resources.files("batchgen.migrations"))
# First key of the advisory locks this project takes (ASCII "BGDP"): + 0 a model's
# dispatch (store.items.lock_model), + 1 a model's admission, + 2 a tenant's
# (store.quotas), + 3 the offload tick (worker.offload_jobs, a session lock: session_lock).
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


# SQLSTATEs of a transaction that PostgreSQL aborted to let another go first: a
# deadlock (40P01) or a serialization failure (40001). Running it again is the cure.
CONFLICT_SQLSTATES = frozenset({"40P01", "40001"})


def is_conflict(error: BaseException) -> bool:
    """True when PostgreSQL aborted the transaction in favour of a concurrent one (a
    deadlock or a serialization failure): no outage, the same work may run again."""
    original = getattr(error, "orig", error)
    return getattr(original, "sqlstate", None) in CONFLICT_SQLSTATES


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


def driver_rows(
    connection: Connection | Session, statement: str, params: Mapping[str, Any]
) -> list[Any]:
    """Run one statement (psycopg's ``%(name)s`` style, see
    :func:`batchgen.store.sqlfiles.driver_query`) on the psycopg connection under
    ``connection``, in its transaction (or its autocommit); returns its rows as named
    tuples (none for a statement without rows).

    For the hot path's claim and record, where SQLAlchemy's own work per execution of
    a textual statement (its result metadata built anew from the cursor, bind and
    result processing) cost more CPU than the statement's round trip. Everything else
    about the connection stays SQLAlchemy's: the pool, the checkout ping, the
    isolation level. An error comes out as SQLAlchemy would raise it (the same
    :class:`sqlalchemy.exc.DBAPIError` subclass, parameters hidden: they hold
    prompts); a lost connection is invalidated, and the pool's idle connections
    (likely dead with it, after a failover) are closed, as SQLAlchemy does on a
    disconnect.
    """
    sa_connection = connection.connection() if isinstance(connection, Session) else connection
    driver: Any = sa_connection.connection.driver_connection
    try:
        with driver.cursor(row_factory=namedtuple_row) as cursor:
            cursor.execute(statement, params)
            return cursor.fetchall() if cursor.description is not None else []
    except psycopg.Error as error:
        lost = sa_connection.dialect.is_disconnect(error, driver, None)  # type: ignore[arg-type]
        if lost:
            sa_connection.invalidate(error)
            sa_connection.engine.pool.dispose()
        raise exc.DBAPIError.instance(
            statement,
            None,
            error,
            psycopg.Error,
            hide_parameters=True,
            connection_invalidated=lost,
            dialect=sa_connection.dialect,
        ) from error


def _make_engine(url: str, settings: Settings) -> Engine:
    engine = create_engine(
        url,
        pool_size=settings.db_pool_size_or_default,
        max_overflow=settings.database.max_overflow,
        pool_timeout=settings.database.pool_timeout_s,
        # Bound parameters hold prompts: never put them in error messages or logs.
        hide_parameters=True,
        pool_recycle=1800,
        connect_args={
            "connect_timeout": CONNECT_TIMEOUT_S,
            # None: psycopg prepares nothing on the server (a transaction pooler
            # would run the next EXECUTE on a server connection that lacks it).
            "prepare_threshold": settings.db_prepare_threshold,
        },
    )
    _ping_if_idle(engine)
    return engine


@functools.cache
def _engine_for(url: str) -> Engine:
    return _make_engine(url, get_settings())


def _dispose(engine: Engine) -> None:
    engine.dispose()


def get_engine(url: str | None = None) -> Engine:
    """The engine for ``url`` (default: the settings' database): the process's own, or,
    inside a host app's :class:`~batchgen.config.SettingsScope`, that app's."""
    target = url or get_settings().sqlalchemy_url
    scope = current_scope()
    if scope is None:
        return _engine_for(target)
    return scope.resource(
        ("engine", target), lambda: _make_engine(target, scope.settings), _dispose
    )


# The direct pool (BATCHGEN_DATABASE_DIRECT_URL) serves session advisory locks: the
# offload tick holds one connection for the whole tick; a second tick of the same
# process meanwhile takes a second one, finds the lock taken and returns.
DIRECT_POOL_SIZE = 1
DIRECT_MAX_OVERFLOW = 1
DIRECT_POOL_BOUND = DIRECT_POOL_SIZE + DIRECT_MAX_OVERFLOW


def _make_direct_engine(url: str) -> Engine:
    engine = create_engine(
        url,
        pool_size=DIRECT_POOL_SIZE,
        max_overflow=DIRECT_MAX_OVERFLOW,
        isolation_level="AUTOCOMMIT",
        hide_parameters=True,
        pool_recycle=1800,
        connect_args={"connect_timeout": CONNECT_TIMEOUT_S, "prepare_threshold": None},
    )
    _ping_if_idle(engine)
    return engine


_direct_engine_cached = functools.cache(_make_direct_engine)


def _direct_engine_for(url: str) -> Engine:
    scope = current_scope()
    if scope is None:
        return _direct_engine_cached(url)
    return scope.resource(("direct", url), lambda: _make_direct_engine(url), _dispose)


@contextmanager
def direct_autocommit() -> Iterator[Connection]:
    """An autocommit connection straight to PostgreSQL (``BATCHGEN_DATABASE_DIRECT_URL``,
    else ``DATABASE_URL``), its own small pool: for session state, which a transaction
    pooler in ``DATABASE_URL`` would not keep (a session advisory lock)."""
    with _direct_engine_for(get_settings().direct_sqlalchemy_url).connect() as connection:
        yield connection


@contextmanager
def session_lock(key: tuple[int, int]) -> Iterator[bool]:
    """A session advisory lock on ``key`` (namespace, key), tried once on a direct
    connection (:func:`direct_autocommit`) and held while the block runs: True when
    this process holds it, False when another does."""
    params = {"ns": key[0], "key": key[1]}
    with direct_autocommit() as connection:
        held = bool(connection.scalar(text("SELECT pg_try_advisory_lock(:ns, :key)"), params))
        try:
            yield held
        finally:
            if held:
                connection.execute(text("SELECT pg_advisory_unlock(:ns, :key)"), params)


@functools.cache
def _process_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


def _factory(url: str) -> sessionmaker[Session]:
    scope = current_scope()
    if scope is None:
        return _process_factory(url)
    return scope.resource(
        ("sessions", url),
        lambda: sessionmaker(get_engine(url), expire_on_commit=False),
        lambda _: None,  # its engine is the scope's, disposed on its own
    )


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
def _process_autocommit_engine(url: str) -> Engine:
    # The same pool; a connection checked out here runs each statement as its own
    # transaction (psycopg's autocommit: no BEGIN and COMMIT round trips).
    return get_engine(url).execution_options(isolation_level="AUTOCOMMIT")


def _autocommit_engine(url: str) -> Engine:
    scope = current_scope()
    if scope is None:
        return _process_autocommit_engine(url)
    return scope.resource(
        ("autocommit", url),
        lambda: get_engine(url).execution_options(isolation_level="AUTOCOMMIT"),
        lambda _: None,  # shares the scope's engine
    )


@contextmanager
def autocommit(url: str | None = None) -> Iterator[Connection]:
    """A connection whose every statement is its own transaction: for the hot path's
    single-statement moves (a claim, marking a call sent), one round trip each."""
    with _autocommit_engine(url or get_settings().sqlalchemy_url).connect() as connection:
        yield connection


def alembic_config(url: str | None = None):  # type: ignore[no-untyped-def]
    """An Alembic config pointing at migrations/ and the given database (default: the
    direct one, ``BATCHGEN_DATABASE_DIRECT_URL``, else ``DATABASE_URL``)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", MIGRATIONS_DIR)
    target = url or get_settings().direct_sqlalchemy_url
    cfg.set_main_option("sqlalchemy.url", target.replace("%", "%%"))
    return cfg


def upgrade(url: str | None = None, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (default database: the direct one)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


# SQLSTATEs of a statement that names a table or column the database does not have:
# on a database batchgen's migrations have not (all) been applied to.
UNMIGRATED_SQLSTATES = frozenset({"42P01", "42703"})  # undefined_table, undefined_column


def schema_revisions(url: str | None = None) -> tuple[str | None, str]:
    """``(the database's Alembic revision, the newest migration's)``; the first is None
    on a database no migration has been applied to."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    with get_engine(url).connect() as connection:
        current = MigrationContext.configure(connection).get_current_revision()
    return current, head or ""


def schema_behind(url: str | None = None) -> str | None:
    """What to tell an operator when the database is not at the newest migration (the
    command that fixes it), or None when it is."""
    current, head = schema_revisions(url)
    if current == head:
        return None
    at = f"at migration {current}" if current else "not migrated"
    return f"the database schema is {at}, this batchgen needs {head}: run `batchgen db upgrade`"
