"""Real servers for the tests.

With ``DATABASE_URL`` / ``REDIS_URL`` set, the tests use those servers but a
database of their own (``batchgen_test_<pid>``, dropped at the end) and a Redis
database of their own (15, then 14, 13 … for each further pytest-xdist worker).
Without them, each worker starts embedded PostgreSQL and Redis of its own.

The suite runs on pytest-xdist workers (``-n auto`` in pyproject.toml; how many:
:func:`pytest_xdist_auto_num_workers`). A file's tests run on one worker, one after
another (``--dist loadfile``): a module's servers are set up once, and a module that
uses something outside its worker (test_multihost's network namespaces,
test_rabbitmq's broker) is never run twice at once. The files likely to take longest
go first (:func:`pytest_collection_modifyitems`), so that no long file starts last.
"""

from __future__ import annotations

import compileall
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from hypothesis import settings as hypothesis_settings

from batchgen.worker import procs
from tests import forkserver, reaper

# A loaded machine is slow, not wrong: no example fails for the time it took
# (hypothesis's default deadline is 200 ms), as no wait of the tests does.
hypothesis_settings.register_profile("batchgen", deadline=None)
hypothesis_settings.load_profile("batchgen")

TEST_REDIS_DB = 15
# Most tests wait on servers, workers and the simulator rather than compute: more
# pytest-xdist workers than cores keeps both cores busy. BATCHGEN_TEST_WORKERS sets it.
WORKERS_PER_CORE = 2
MAX_WORKERS = 8
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


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two workers per core (at most eight), or BATCHGEN_TEST_WORKERS."""
    if os.environ.get("BATCHGEN_TEST_WORKERS"):
        return int(os.environ["BATCHGEN_TEST_WORKERS"])
    return min(MAX_WORKERS, WORKERS_PER_CORE * (os.cpu_count() or 1))


# The checkout's Python sources: the installed package (editable) and the tests.
ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("app", "tasks", "migrations", "celeryconfig.py", "tests")


def _bytecode_written_once() -> None:
    """Compile the checkout's sources once, before the run's processes start, and let
    those processes write bytecode.

    Under ``PYTHONDONTWRITEBYTECODE`` (which some machines set), every Python process
    compiled batchgen's modules again when it imported them: about 0.2 s of CPU in
    each of the suite's ~300 worker starts, and more in each pytest process (its
    rewritten test modules). pip compiles what it installs; the editable checkout is
    compiled here, as pip would. The run's processes (and nothing outside it) may write
    what is still missing (pytest's rewritten test modules)."""
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            compileall.compile_dir(path, quiet=1)
        elif path.exists():
            compileall.compile_file(path, quiet=1)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


def _rewritten_tests_cached(config: pytest.Config) -> None:
    """pytest's rewrite of the test modules (their asserts), done once and cached where
    pytest caches it: each pytest-xdist worker then reads it instead of rewriting every
    test module again (about 7 s of CPU each). It uses pytest's own functions, which are
    not public: if they have moved, each worker rewrites as before."""
    try:
        from _pytest.assertion import rewrite

        state = config.stash[rewrite.assertstate_key]
        for path in sorted((ROOT / "tests").rglob("*.py")):
            if not (path.name.startswith("test_") or path.name == "conftest.py"):
                continue
            cache_dir = rewrite.get_cache_dir(path)
            pyc = cache_dir / (path.name[:-3] + rewrite.PYC_TAIL)
            if rewrite._read_pyc(path, pyc, state.trace) is not None:
                continue  # cached, and still this source's
            if rewrite.try_makedirs(cache_dir):
                source_hash, code = rewrite._rewrite_test(path, config)
                rewrite._write_pyc(state, code, source_hash, pyc)
    except Exception as exc:  # noqa: BLE001 - a cache only: the workers rewrite instead
        print(f"tests/conftest.py: test modules not pre-rewritten: {exc!r}", file=sys.stderr)


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker starts with ``COLUMNS=80`` and ``LINES=24`` of its own making,
    which the CLI's consoles (made at import) would keep: a worker's environment is
    put back to what a run without workers has. Every process the run starts is
    marked and reaped at its end (:mod:`tests.reaper`). The run's first process
    compiles the checkout (:func:`_bytecode_written_once`) and, for its pytest-xdist
    workers, rewrites the test modules (:func:`_rewritten_tests_cached`)."""
    reaper.install()
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # before any worker starts
        _bytecode_written_once()
        if config.getoption("numprocesses", None):  # workers to read it
            _rewritten_tests_cached(config)
    if forkserver.enabled():  # workers forked from a process with their imports done
        procs.default_spawn = forkserver.spawn
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for name in ("COLUMNS", "LINES"):
            os.environ.pop(name, None)


def pytest_unconfigure(config: pytest.Config) -> None:
    """After the session's teardown (an interrupted one's too): stop whatever process
    of this run a failure or an interrupt left running."""
    reaper.reap()


# Rough seconds of a test, to order files by: slow (``@pytest.mark.slow`` at the test
# or in its module's pytestmark), other integration tests, unit tests.
SECONDS_SLOW, SECONDS_INTEGRATION, SECONDS_UNIT = 10.0, 0.5, 0.05


def _expected_s(item: pytest.Item) -> float:
    if item.get_closest_marker("slow"):
        return SECONDS_SLOW
    return SECONDS_INTEGRATION if item.get_closest_marker("integration") else SECONDS_UNIT


@pytest.hookimpl(trylast=True)  # after the integration folder's hook marks its tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files in order of their expected length (:func:`_expected_s`), each file's tests
    in their own order: xdist hands whole files out in this order."""
    weight: dict[str, float] = {}
    for item in items:
        path = str(item.path)
        weight[path] = weight.get(path, 0.0) + _expected_s(item)
    first_seen = {path: n for n, path in enumerate(dict.fromkeys(str(i.path) for i in items))}
    items.sort(key=lambda i: (-weight[str(i.path)], first_seen[str(i.path)]))


def worker_index() -> int:
    """This pytest-xdist worker's number (0 for ``gw0`` and for a run without xdist)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name.removeprefix("gw") or 0)


def _redis_test_url(url: str) -> str:
    """The same Redis server, a database of this worker's (15, 14, …), so the shared
    database 0 and the other workers' are left alone."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{TEST_REDIS_DB - worker_index()}"))


def _broker_follows_the_settings() -> None:
    """batchgen's Celery app reads its broker once per process (``batchgen.celeryconfig``
    at import): if that happened under a module's own broker (test_multihost's Redis in
    a network namespace, gone once the module ends), a later test of this worker would
    publish there. Point it at the broker of the settings now, with fresh connections."""
    publish = sys.modules.get("batchgen.worker.publish")
    if publish is None:
        return
    from batchgen.config import get_settings

    app = publish.celery_app
    try:
        wanted = get_settings().broker_url
    except Exception:  # no broker (or no valid settings) in this test's environment
        return
    if app.conf.broker_url == wanted:
        return
    app.conf.broker_url = wanted
    # Only forgotten, not closed: kombu keeps its pools per broker address, and this
    # address's (open, if it was used before) is the one taken from now on.
    app._pool = None
    app.amqp._producer_pool = None


class _SettingsSeen:
    """The process's cached settings as a test left them, and the environment they
    were read from: the next test keeps them if neither changed (a build of the
    settings is about 7 ms of CPU, at every test before)."""

    settings: object | None = None
    environ: dict[str, str] = {}


def _cached_settings() -> object | None:
    """The process's settings if they are cached (never read them anew)."""
    from batchgen.config import _process_settings

    return _process_settings() if _process_settings.cache_info().currsize else None


def _forget_settings() -> None:
    from batchgen.config import get_settings
    from batchgen.registry import load_registry

    get_settings.cache_clear()
    load_registry.cache_clear()
    _SettingsSeen.settings = None


@pytest.fixture(autouse=True)
def _settings_follow_the_environment() -> Iterator[None]:
    """Before each test, batchgen's Celery app publishes to the broker of the settings
    (:func:`_broker_follows_the_settings`); after it, the cached settings and registry
    are read again from the environment unless nothing changed (:class:`_SettingsSeen`):
    a test that changed them (and put the environment back at its teardown), or a
    fixture that changed the environment between tests, leaves nothing of its own to
    the next test or module."""
    if os.environ != _SettingsSeen.environ or _cached_settings() is not _SettingsSeen.settings:
        _forget_settings()
    _broker_follows_the_settings()
    environ, settings = dict(os.environ), _cached_settings()
    yield
    if os.environ != environ or settings is None or _cached_settings() is not settings:
        _forget_settings()
        _SettingsSeen.environ = {}
    else:
        from batchgen.registry import load_registry

        load_registry.cache_clear()  # under 1 ms: read again
        _SettingsSeen.settings, _SettingsSeen.environ = settings, environ


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
            postgres = stack.enter_context(embedded.private_postgres())
            server_url = str(postgres.get_uri())
            reaper.guard_daemon(postmaster_pid(postgres))
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
        stack.callback(_close_call_waiters)  # before the servers stop (callbacks run LIFO)
        db.upgrade()
        yield {"DATABASE_URL": db_url, "REDIS_URL": redis_url, "server_url": server_url}


def postmaster_pid(postgres: Any) -> int:
    """The pid of an embedded PostgreSQL (pgserver's handle): its postmaster.pid's first
    line."""
    return int((Path(postgres.pgdata) / "postmaster.pid").read_text().split()[0])


def _close_call_waiters() -> None:
    from batchgen.worker.call_runner import close_call_waiters

    close_call_waiters()


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


# A test's rows are deleted (about 4 ms of PostgreSQL's CPU for the few most tests
# leave); TRUNCATE makes every table and index a new file (about 50 ms), so it is kept
# for a history of more than this many items.
LARGE_ROWS = 5000


def _empty_tables(conn: Any) -> None:
    """Empty the schema's tables (children before their parents) and restart their
    ids, as ``TRUNCATE ... RESTART IDENTITY`` would: under the same exclusive locks,
    so that no process's row lands between two of the deletes."""
    from sqlalchemy import text

    from tests.helpers import emptied_tables, truncate_tables

    names = emptied_tables()
    tables = ", ".join(names)
    large = conn.execute(
        text(f"SELECT count(*) FROM (SELECT 1 FROM items LIMIT {LARGE_ROWS + 1}) AS head")
    ).scalar()
    if large > LARGE_ROWS:
        truncate_tables(conn)
        return
    conn.execute(text(f"LOCK TABLE {tables} IN ACCESS EXCLUSIVE MODE"))
    for name in names:
        conn.execute(text(f"DELETE FROM {name}"))
    conn.execute(
        text(
            "SELECT setval(s.oid::regclass, 1, false) FROM pg_class s"
            " JOIN pg_depend d ON d.objid = s.oid AND d.deptype IN ('a', 'i')"
            " JOIN pg_class t ON t.oid = d.refobjid"
            " WHERE s.relkind = 'S' AND t.relname = ANY(:tables)"
        ),
        {"tables": names},
    )


@pytest.fixture
def clean_db(services: dict[str, str]) -> dict[str, str]:
    """Empty tables and an empty Redis database (the broker's bindings kept, the gate's
    state marked known good) before the test."""
    import redis
    from sqlalchemy import text

    from batchgen.limits import redis_keys as keys
    from batchgen.store import db
    from batchgen.store.db import get_engine

    # A module's workers or API server may be mid-statement: the locks taken here can
    # then deadlock with theirs, and PostgreSQL may pick this transaction to abort. Again.
    for last_try in (False, False, False, True):
        try:
            with get_engine().begin() as conn:
                _empty_tables(conn)
                conn.execute(text("UPDATE totals_watermark SET rolled_up_before = NULL"))
            break
        except Exception as exc:
            if last_try or not db.is_conflict(exc):
                raise
    client = redis.Redis.from_url(services["REDIS_URL"])
    clear_redis(client)
    # Both stores are empty, as at a first start: the gate's state is known good. (A
    # process that outlives the test would otherwise find the marker gone and take its
    # own calls since as evidence of lost state: app/worker/gate_recovery.py.)
    client.set(keys.gate_state(), "clean_db")
    return services


# kombu's Redis transport keeps each exchange's queue bindings under this prefix. A
# process declares them once (kombu remembers what it declared): without them its
# messages would go to no queue, so a worker or API process that outlives a test
# (module_workers, module_api_server) needs them kept.
KOMBU_BINDINGS = b"_kombu.binding."


def clear_redis(client: Any) -> None:
    """Delete every key of the database but the broker's bindings."""
    doomed = [k for k in client.scan_iter(count=1000) if not k.startswith(KOMBU_BINDINGS)]
    for start in range(0, len(doomed), 1000):
        client.delete(*doomed[start : start + 1000])


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
