"""PostgreSQL connections: a process's budget, and batchgen behind PgBouncer.

The budget (docs/operations.md, "Connections"): a process's pool to ``DATABASE_URL`` opens at
most ``BATCHGEN_DB_POOL_SIZE`` + ``BATCHGEN_DB_MAX_OVERFLOW`` connections whatever
its thread count, plus :data:`batchgen.store.db.DIRECT_POOL_BOUND` straight to
PostgreSQL in a process that runs the offload tick, plus one ``LISTEN`` connection
in a process that answers synchronous calls. Behind PgBouncer in transaction mode
(Debian's package, installed here when missing), real worker processes run a real
batch with ``DATABASE_URL`` pointing at PgBouncer, and the server connections the
test database sees stay within PgBouncer's pool.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from batchgen import python_api as client
from batchgen.config import Settings, get_settings
from batchgen.embedded import free_port
from batchgen.registry import load_registry
from batchgen.serving import pool_size_for
from batchgen.store import db
from batchgen.store.call_rows import CHANNEL, listener_name
from batchgen.store.schema import Item, Result, UsageLedger
from batchgen.worker.call_runner import call_waiter
from batchgen.worker.offload_jobs import TICK_LOCK, single_flight
from tests.helpers import (
    assert_ledger_is_results_plus_waste,
    chat_line,
    make_tenant,
    models_file_with,
    status_summary,
    wait_batches,
)
from tests.waiting import wait_until

THREADS = 16  # per worker process
BOUNCER_POOL = 4  # PgBouncer's server connections for the test database
DIRECT_LABEL = "batchgen-test-direct"


# --- PgBouncer ----------------------------------------------------------------------


def _install_pgbouncer() -> str | None:
    """Debian's pgbouncer, installed if missing; None when it cannot be (not root, no apt)."""
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "--no-install-recommends", "pgbouncer"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:  # an old package list: refresh it once
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=900)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        return None
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")


@pytest.fixture(scope="module")
def pgbouncer_binary() -> str:
    binary = _install_pgbouncer()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("pgbouncer could not be installed (Debian's package, as root)")
        pytest.skip("no pgbouncer here, and no root to install Debian's package")
    return binary


def _run_as(params: dict[str, Any]) -> list[str]:
    """PgBouncer refuses to run as root: as root, run it as the owner of the server's
    socket folder (who can reach the socket), else as ``postgres`` or ``nobody``."""
    if os.geteuid() != 0:
        return []
    host = str(params.get("host") or "")
    if host.startswith("/"):
        owner = pwd.getpwuid(Path(host).stat().st_uid).pw_name
        if owner != "root":
            return ["-u", owner]
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return ["-u", name]
    raise RuntimeError("no user to run pgbouncer as")


@dataclass
class Bouncer:
    """A PgBouncer of the test's own in front of the test database."""

    process: subprocess.Popen[bytes]
    port: int
    user: str
    dbname: str
    log_path: Path

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.dbname}"

    def admin(self, command: str) -> list[dict[str, Any]]:
        """A ``SHOW`` on PgBouncer's admin console (the simple query protocol)."""
        dsn = f"host=127.0.0.1 port={self.port} dbname=pgbouncer user={self.user}"
        with psycopg.connect(dsn, autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
            cur = conn.execute(command)
            names = [c.name for c in cur.description or []]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])


@pytest.fixture
def bouncer(pgbouncer_binary: str, services: dict[str, str], tmp_path: Path) -> Iterator[Bouncer]:
    """PgBouncer (pool_mode = transaction, BOUNCER_POOL server connections) in front of
    the test database, on a port of its own; its config and auth file in ``tmp_path``."""
    params = conninfo_to_dict(services["DATABASE_URL"])
    user, dbname = str(params.get("user") or "postgres"), str(params["dbname"])
    target = f"host={params.get('host') or '127.0.0.1'} port={params.get('port') or 5432}"
    port = free_port()
    auth = tmp_path / "pgbouncer-users.txt"
    password = str(params.get("password") or "")
    auth.write_text(f'"{user}" "{password}"\n')
    config = tmp_path / "pgbouncer.ini"
    config.write_text(
        f"""[databases]
{dbname} = {target} dbname={dbname} user={user}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {auth}
admin_users = {user}
pool_mode = transaction
default_pool_size = {BOUNCER_POOL}
min_pool_size = 0
reserve_pool_size = 0
max_db_connections = {BOUNCER_POOL}
max_client_conn = 1000
"""
    )
    log_path = tmp_path / "pgbouncer.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [pgbouncer_binary, *_run_as(params), str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    found = Bouncer(process, port, user, dbname, log_path)
    try:

        def answers() -> bool:  # its admin console: no server connection opened yet
            if process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited: {found.log_tail()}")
            try:
                found.admin("SHOW VERSION")
                return True
            except psycopg.OperationalError:
                return False

        wait_until(answers, 20, lambda: f"pgbouncer up: {found.log_tail()}")
        yield found
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- Sampling the server's connections ------------------------------------------------


class Sampler:
    """Counts the backends of the test database every few milliseconds, per
    ``application_name`` (connections through PgBouncer carry none), on a connection
    of its own (not counted), until stopped. Backends already there when it starts
    (this pytest process's own, left by earlier tests: its pool, a call listener)
    are not the run's and are not counted: start it before the processes it watches,
    since a pool keeps the connections it opened at start-up (and a sampler started
    later would count none of them)."""

    def __init__(self, url: str, dbname: str, every_s: float = 0.02) -> None:
        self.url, self.dbname, self.every_s = url, dbname, every_s
        self.samples: list[dict[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pg-sampler", daemon=True)
        self._started = threading.Event()

    def _run(self) -> None:
        where = "WHERE datname = %s AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        query = (
            f"SELECT coalesce(application_name, ''), count(*) FROM pg_stat_activity {where} "
            "AND NOT pid = ANY(%s) GROUP BY 1"
        )
        with psycopg.connect(self.url, autocommit=True) as conn:
            before = conn.execute(f"SELECT pid FROM pg_stat_activity {where}", (self.dbname,))
            baseline = [int(pid) for (pid,) in before.fetchall()]
            self._started.set()
            while not self._stop.is_set():
                rows = conn.execute(query, (self.dbname, baseline)).fetchall()
                self.samples.append({str(label): int(n) for label, n in rows})
                self._stop.wait(self.every_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        assert self._started.wait(10), "the sampler could not read pg_stat_activity"
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def peak(self, accept: Callable[[str], bool] = lambda label: True) -> int:
        """The most backends seen at once whose label ``accept`` takes."""
        return max(
            (sum(n for label, n in s.items() if accept(label)) for s in self.samples), default=0
        )


# --- The run ----------------------------------------------------------------------------


def _labelled(url: str, label: str) -> str:
    """``url`` whose connections carry ``application_name`` ``label``."""
    return (
        make_url(url)
        .update_query_dict({"application_name": label})
        .render_as_string(hide_password=False)
    )


def _run_batch(tenant: str, n: int) -> str:
    """Submit ``n`` requests for a new tenant and wait for the batch's end."""
    make_tenant(tenant)
    lines = [chat_line(f"{tenant}-{i}", max_tokens=20) for i in range(n)]
    batch_id = str(client.submit_batch(lines, tenant=tenant)["id"])
    wait_batches([batch_id], timeout_s=60)
    return batch_id


def _assert_each_succeeded_once(batch_id: str, n: int) -> None:
    with db.session_scope() as session:
        statuses = dict(
            session.execute(
                select(Item.status, func.count())
                .where(Item.batch_id == batch_id)
                .group_by(Item.status)
            ).all()
        )
        results = session.scalar(
            select(func.count()).select_from(Result).join(Item).where(Item.batch_id == batch_id)
        )
        ledgered = session.scalar(
            select(func.count(func.distinct(UsageLedger.item_id)))
            .join(Item, Item.id == UsageLedger.item_id)
            .where(Item.batch_id == batch_id)
        )
    assert statuses == {"succeeded": n}, status_summary()
    assert results == n
    assert ledgered == n
    assert_ledger_is_results_plus_waste()


@pytest.fixture
def through(
    services: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., None]]:
    """Point this process's settings at other URLs for the test (then back, with its
    engines for them closed)."""
    used: list[str] = []

    def point(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        get_settings.cache_clear()
        load_registry.cache_clear()
        used.append(get_settings().sqlalchemy_url)

    yield point
    for url in used:
        db.get_engine(url).dispose()
    db._direct_engine_for(get_settings().direct_sqlalchemy_url).dispose()
    monkeypatch.undo()
    get_settings.cache_clear()
    load_registry.cache_clear()


def _worker_env(tmp_path: Path, database_url: str, direct_url: str, **extra: str) -> dict[str, str]:
    return {
        "DATABASE_URL": database_url,
        "BATCHGEN_DATABASE_DIRECT_URL": direct_url,
        "BATCHGEN_WORKER_CONCURRENCY": str(THREADS),
        "BATCHGEN_MODELS_FILE": str(
            models_file_with(tmp_path / "models.toml", max_concurrency=4 * THREADS)
        ),
        **extra,
    }


def _assert_clean_logs(workers: list[Any]) -> None:
    """No pool starved into time-outs, no statement lost across server connections."""
    for worker in workers:
        text = worker.log_path.read_text(errors="replace")
        for sign in ("QueuePool limit", "prepared statement", "DatabaseError", "OperationalError"):
            assert sign not in text, f"{worker.name}: {sign!r} in its log: {worker.log_tail()}"


@pytest.mark.slow
def test_worker_and_api_processes_keep_to_their_connection_budget(
    clean_db: dict[str, str],
    simulator: Any,
    workers: Callable[..., Any],
    api_server: Callable[..., str],
    tmp_path: Path,
) -> None:
    """Without PgBouncer. A worker of 16 threads that also dispatches and sweeps (beat
    embedded) opens at most its pool's bound to DATABASE_URL (the default: a quarter of
    its threads) and at most DIRECT_POOL_BOUND straight to PostgreSQL; ``batchgen api``
    serving 32 requests at once and a synchronous call, at most its worker processes'
    pools (each sized for its threads: app/serving.py) and one LISTEN connection."""
    settings = Settings(worker_concurrency=THREADS)
    assert (settings.db_pool_bound, db.DIRECT_POOL_BOUND) == (4, 2)  # as docs/operations.md says
    url = clean_db["DATABASE_URL"]

    def env(role: str) -> dict[str, str]:
        return _worker_env(tmp_path, _labelled(url, role), _labelled(url, f"{role}-direct"))

    key = make_tenant("budget")
    n = 200
    lines = [chat_line(f"budget-{i}", max_tokens=20) for i in range(n)]
    with Sampler(url, make_url(url).database or "") as sampler:
        worker = workers(concurrency=THREADS, beat=True, env=env("budget-worker"), wait=False)
        base_url = api_server(env=env("budget-api"))
        worker.wait_ready()
        batch_id = str(client.submit_batch(lines, tenant="budget")["id"])
        with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}) as http:

            def read(_: int) -> int:
                return http.get(f"/v1/batches/{batch_id}", timeout=30).status_code

            with ThreadPoolExecutor(2 * THREADS) as pool:
                statuses = set(pool.map(read, range(8 * THREADS)))
            asked = {"model": "sim-small", "max_tokens": 5}
            asked["messages"] = [{"role": "user", "content": "x"}]
            answer = http.post("/v1/chat/completions", json=asked, timeout=60)
        wait_batches([batch_id], timeout_s=60)
    assert statuses == {200}
    assert answer.status_code == 200, answer.text
    _assert_each_succeeded_once(batch_id, n)
    peaks = {
        role: sampler.peak(lambda label, role=role: label == role)  # type: ignore[misc]
        for role in ("budget-worker", "budget-worker-direct", "budget-api", "budget-api-direct")
    }
    listeners = sampler.peak(lambda label: label.startswith("batchgen call listener"))
    print(f"threads {THREADS}: peaks {peaks}, LISTEN {listeners}")
    assert 1 <= peaks["budget-worker"] <= settings.db_pool_bound
    assert peaks["budget-worker-direct"] <= db.DIRECT_POOL_BOUND
    api_bound = settings.api.workers * pool_size_for(settings.api.threads)
    assert (settings.api.workers, api_bound) == (2, 16)  # as docs/operations.md says
    assert 1 <= peaks["budget-api"] <= api_bound
    assert peaks["budget-api-direct"] == 0  # the API runs no offload tick
    assert listeners == 1
    _assert_clean_logs([worker])


class PoolWatch:
    """PgBouncer's ``SHOW POOLS`` for the test database, sampled until stopped: the most
    client connections it served at once, and the most server connections it held."""

    def __init__(self, bouncer: Bouncer) -> None:
        self.bouncer = bouncer
        self.clients = self.servers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for pool in self.bouncer.admin("SHOW POOLS"):
                if pool["database"] != self.bouncer.dbname:
                    continue
                clients = int(pool["cl_active"]) + int(pool["cl_waiting"])
                servers = sum(
                    int(pool[k])
                    for k in ("sv_active", "sv_idle", "sv_used", "sv_tested", "sv_login")
                )
                self.clients, self.servers = max(self.clients, clients), max(self.servers, servers)
            self._stop.wait(0.05)

    def __enter__(self) -> PoolWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.slow
def test_a_batch_runs_through_pgbouncer_in_transaction_mode(
    bouncer: Bouncer,
    through: Callable[..., None],
    clean_db: dict[str, str],
    simulator: Any,
    workers: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """Two worker processes of 16 threads, one connection per thread to PgBouncer
    (BATCHGEN_DB_POOL_SIZE=16), PgBouncer holding 4 to PostgreSQL: every item succeeds
    exactly once, and the test database never sees more than those 4 (besides the
    direct connections of the offload tick's lock)."""
    direct = clean_db["DATABASE_URL"]
    db.get_engine().dispose()  # this process too goes through PgBouncer from here on
    through(DATABASE_URL=bouncer.url, BATCHGEN_DATABASE_DIRECT_URL=_labelled(direct, DIRECT_LABEL))
    env = _worker_env(
        tmp_path, bouncer.url, _labelled(direct, DIRECT_LABEL), BATCHGEN_DB_POOL_SIZE=str(THREADS)
    )
    n = 300
    with Sampler(direct, bouncer.dbname) as sampler, PoolWatch(bouncer) as pools:
        started = [
            workers(concurrency=THREADS, beat=beat, env=env, wait=False) for beat in (True, False)
        ]
        for worker in started:
            worker.wait_ready()
        batch_id = _run_batch("bounced", n)
    _assert_each_succeeded_once(batch_id, n)
    through_bouncer = sampler.peak(
        lambda label: not label.startswith((DIRECT_LABEL, "batchgen call"))
    )
    direct_peak = sampler.peak(lambda label: label.startswith(DIRECT_LABEL))
    print(
        f"through pgbouncer: server connections peak {through_bouncer} (SHOW POOLS: "
        f"{pools.servers} servers for up to {pools.clients} clients), direct peak {direct_peak}"
    )
    assert 1 <= through_bouncer <= BOUNCER_POOL
    assert pools.servers <= BOUNCER_POOL < pools.clients  # the clients did share them
    assert direct_peak <= db.DIRECT_POOL_BOUND  # the one worker running the offload tick
    _assert_clean_logs(started)


def test_listen_and_the_offload_lock_bypass_pgbouncer(
    bouncer: Bouncer, through: Callable[..., None], clean_db: dict[str, str]
) -> None:
    """With DATABASE_URL at PgBouncer, migrations, a synchronous call's LISTEN and the
    offload tick's session advisory lock use BATCHGEN_DATABASE_DIRECT_URL: the lock is
    held by a direct session for the whole tick and is gone after it, and a NOTIFY
    wakes the listener."""
    direct = clean_db["DATABASE_URL"]
    through(DATABASE_URL=bouncer.url, BATCHGEN_DATABASE_DIRECT_URL=_labelled(direct, DIRECT_LABEL))
    holders = (
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
        "WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objid = %s AND l.granted"
    )
    # Migrations too (batchgen db upgrade).
    assert (
        db.alembic_config().get_main_option("sqlalchemy.url")
        == get_settings().direct_sqlalchemy_url
    )
    with psycopg.connect(direct, autocommit=True) as watcher:
        with single_flight() as held:
            assert held
            assert watcher.execute(holders, TICK_LOCK).fetchall() == [(DIRECT_LABEL,)]
        assert watcher.execute(holders, TICK_LOCK).fetchall() == []

        def listening() -> int:
            """This process's LISTEN sessions on PostgreSQL itself (an earlier test may
            have left one of its own, on another URL)."""
            row = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND query = %s",
                (listener_name(os.getpid()), f"LISTEN {CHANNEL}"),
            ).fetchone()
            return int(row[0]) if row else 0

        before = listening()
        waiter = call_waiter()
        assert waiter.dsn == _labelled(direct, DIRECT_LABEL)
        item_id = 2_000_000_001
        woken = waiter.register(item_id, ready_timeout_s=10)
        try:
            # One session more, or the one this URL's waiter already had.
            assert listening() >= 1 and listening() - before in (0, 1)
            with psycopg.connect(bouncer.url, autocommit=True) as other:  # any session may NOTIFY
                other.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(item_id)))
            assert woken.wait(10), "the listener heard nothing"
        finally:
            waiter.forget(item_id)
