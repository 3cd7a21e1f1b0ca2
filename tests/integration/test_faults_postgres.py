"""PostgreSQL faults, injected mid-run into a PostgreSQL server of this module's own:
a restart, 30 s of being unreachable while calls are in flight (a TCP proxy in front
of it is cut), and a submit while it is down.

The workers and the API server reach PostgreSQL through the proxy
(:class:`tests.tcp_proxy.TcpProxy`); the test process itself connects directly, to
submit and to check. Each test first proves that its fault really hit, then
checks the shared invariants (:func:`tests.invariants.check_invariants`). The
shared PostgreSQL is never touched.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from batchgen import embedded, tenant_admin
from batchgen.config import get_settings
from batchgen.limits.backend import get_redis
from batchgen.store import db
from batchgen.store.schema import Batch, Item
from tests import http_client
from tests.helpers import (
    FAULT_ENV,
    chat_line,
    jsonl,
    make_tenant,
    sim_config,
    submit_items,
    succeeded_items,
    wait_batches,
    wait_mid_run,
)
from tests.invariants import (
    assert_budget_settled,
    check_invariants,
    reset_simulator,
    simulator_log,
)
from tests.tcp_proxy import TcpProxy
from tests.waiting import hold

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DOWN_S = 3  # how long the restarted server stays down
OUTAGE_S = 30


def _bin_dir() -> Path:
    """PostgreSQL's binaries: those of the pgserver wheel (a dependency), else Debian's."""
    with contextlib.suppress(ImportError):
        from pgserver._commands import POSTGRES_BIN_PATH

        if (POSTGRES_BIN_PATH / "pg_ctl").exists():
            return Path(POSTGRES_BIN_PATH)
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "pg_ctl").exists():
            return candidate
    pytest.skip("no PostgreSQL binaries (pgserver or /usr/lib/postgresql)")


def _server_user() -> str | None:
    """PostgreSQL refuses to run as root: as root, run it as an unprivileged user."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "pgserver"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    pytest.skip("running as root and no 'postgres' or 'pgserver' user to run PostgreSQL")


class OwnPostgres:
    """A PostgreSQL server of this module's own, on a free loopback port.

    Its data lives in a directory of its own under the system temp folder, not under
    pytest's temporary root, which another pytest run may make unreadable."""

    def __init__(self) -> None:
        self.bin = _bin_dir()
        self.user = _server_user()
        self.port = embedded.free_port()
        self.root = Path(tempfile.mkdtemp(prefix="batchgen-faults-pg-"))
        self.root.chmod(0o755)
        self.data = self.root / "data"
        self.log = self.root / "server.log"

    def _run(self, *argv: str) -> None:
        subprocess.run(
            [str(self.bin / argv[0]), *argv[1:]],
            check=True,
            user=self.user,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )

    def init(self) -> None:
        if self.user is not None:
            pw = pwd.getpwnam(self.user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self._run(
            "initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--encoding=utf8"
        )

    def start(self) -> None:
        options = f"-p {self.port} -h 127.0.0.1 -k {self.root} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def postmaster_pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"


@dataclass
class PgSetup:
    server: OwnPostgres
    proxy: TcpProxy
    direct_url: str  # the test process
    proxied_url: str  # workers and API servers

    def worker_env(self, **extra: str) -> dict[str, str]:
        return {**FAULT_ENV, "DATABASE_URL": self.proxied_url, **extra}


@pytest.fixture(scope="module")
def own_pg(services: dict[str, str]) -> Iterator[PgSetup]:
    """Own PostgreSQL, migrated, with a proxy in front; the test process's
    ``DATABASE_URL`` points at it (directly) for the module."""
    server = OwnPostgres()
    proxy = None
    saved = os.environ["DATABASE_URL"]
    try:
        server.init()
        server.start()
        direct = embedded.ensure_database(server.url, "batchgen_faults")
        db.upgrade(direct)
        proxy = TcpProxy("127.0.0.1", server.port).start()
        proxied = make_url(direct).set(port=proxy.port).render_as_string(hide_password=False)
        os.environ["DATABASE_URL"] = direct
        get_settings.cache_clear()
        yield PgSetup(server, proxy, direct, proxied)
    finally:
        if os.environ["DATABASE_URL"] != saved:
            db.get_engine().dispose()
        os.environ["DATABASE_URL"] = saved
        get_settings.cache_clear()
        if proxy is not None:
            proxy.stop()
        server.remove()


@pytest.fixture
def sim(own_pg: PgSetup, simulator: Any, clean_db: dict[str, str]) -> Iterator[Any]:
    """The simulator with an empty log; the module's database emptied (``clean_db``
    empties the database of the current settings: the module's own)."""
    own_pg.proxy.restore()
    reset_simulator(simulator.base_url)
    yield simulator
    sim_config(simulator.base_url, latency_base_ms=50)


def _answered_between(simulator_url: str, start_ts: float, end_ts: float) -> int:
    """Complete answers the provider gave between two moments (epoch seconds)."""
    return sum(
        1
        for e in simulator_log(simulator_url)
        if e["status"] == 200 and e["completed"] and start_ts < e["end_ts"] < end_ts
    )


@dataclass(frozen=True)
class _Cut:
    closed: int  # worker connections the proxy closed
    done_at_cut: int  # items succeeded when it did
    cut_at: float
    restored_at: float

    def check_it_hit(self, simulator_url: str) -> None:
        assert self.closed > 0, "no worker connection went through the proxy"
        assert _answered_between(simulator_url, self.cut_at, self.restored_at), (
            "no paid answer arrived while the database was unreachable"
        )


def _cut_for(own_pg: PgSetup, outage_s: float, batch_id: str) -> _Cut:
    """Make PostgreSQL unreachable for the workers for ``outage_s`` (the proxy closes
    their connections and refuses new ones), then reachable again."""
    cut_at = time.time()
    closed = own_pg.proxy.cut()
    try:
        done_at_cut = succeeded_items(batch_id)
        hold(outage_s - (time.time() - cut_at), "the outage's length")
    finally:
        own_pg.proxy.restore()
    return _Cut(closed, done_at_cut, cut_at, time.time())


def test_postgres_restarted_mid_run(sim, workers, own_pg):
    """PostgreSQL goes down hard (immediate shutdown, as a crash) mid-run and comes back
    after a few seconds: every connection of the workers breaks, and the calls in
    flight come back to a database that is not there."""
    sim_config(sim.base_url, latency_base_ms=300)
    batch_id = submit_items("pgrestart", 100)
    workers(env=own_pg.worker_env(), name="worker")
    wait_mid_run(sim.base_url, batch_id)
    old_pid = own_pg.server.postmaster_pid()
    done_before_stop = succeeded_items(batch_id)
    connections = own_pg.proxy.open_connections
    stopped_at = time.time()
    own_pg.server.stop("immediate")
    hold(DOWN_S, "PostgreSQL stays down")
    own_pg.server.start()
    started_at = time.time()
    wait_batches([batch_id], timeout_s=120)

    assert own_pg.server.postmaster_pid() != old_pid
    assert connections > 0, "the workers had no connection open to the database"
    assert done_before_stop < 100, "the run was over before the restart"
    assert _answered_between(sim.base_url, stopped_at, started_at), (
        "no paid answer arrived while the database was down"
    )
    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": 100}


def test_postgres_unreachable_30s_during_calls(sim, workers, own_pg):
    """PostgreSQL is unreachable for 30 s while calls are in flight: the proxy closes
    every connection of the workers and refuses new ones. Paid answers arrive during
    the outage and must be recorded once it ends, exactly once.

    30 s is longer than the 2 s that recording a result retries today and than a
    SQLAlchemy pool time-out (30 s); the running lease of this test (2 x 15 s call
    time-out + 5 s = 35 s) outlasts the outage, as a lease must."""
    sim_config(sim.base_url, latency_base_ms=500)
    batch_id = submit_items("pgcut", 100)
    tenant_admin.set_budget("pgcut", limit_usd="100", period="total")  # ample: never refuses
    env = own_pg.worker_env(
        BATCHGEN_CALL_TIMEOUT_S="15",
        BATCHGEN_RUNNING_LEASE_MARGIN_S="5",
    )
    workers(env=env, name="worker")
    wait_mid_run(sim.base_url, batch_id)
    cut = _cut_for(own_pg, OUTAGE_S, batch_id)
    wait_batches([batch_id], timeout_s=150)

    assert cut.done_at_cut < 100
    cut.check_it_hit(sim.base_url)
    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": 100}
    assert_budget_settled("pgcut")


LEASE_S = 4.0  # the running lease of the next test: 2 x 1.5 s call time-out + 1 s
LONG_OUTAGE_S = 9.0


def test_postgres_unreachable_longer_than_the_running_lease(sim, workers, own_pg):
    """PostgreSQL is unreachable for 9 s, more than twice the running lease (4 s), while
    two workers have calls in flight. The leases run out in PostgreSQL meanwhile; the
    workers are alive, and their heartbeat in Redis says so: when PostgreSQL is back,
    the sweep hands none of their items to another worker, and every item is paid for
    exactly once (one billed call each), its answer recorded."""
    sim_config(sim.base_url, latency_base_ms=600)
    env = own_pg.worker_env(
        BATCHGEN_CALL_TIMEOUT_S="1.5",
        BATCHGEN_RUNNING_LEASE_MARGIN_S="1",
        BATCHGEN_HEARTBEAT_INTERVAL_S="0.5",
    )
    workers(env=env, name="worker-a")
    workers(env=env, name="worker-b", beat=False)
    batch_id = submit_items("pglong", 80)
    wait_mid_run(sim.base_url, batch_id, at_least=5)
    cut = _cut_for(own_pg, LONG_OUTAGE_S, batch_id)
    wait_batches([batch_id], timeout_s=120)

    assert cut.done_at_cut < 80, "the run was over before the outage"
    assert cut.restored_at - cut.cut_at > 2 * LEASE_S
    cut.check_it_hit(sim.base_url)
    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": 80}
    assert report.billed_calls == 80, f"{report.billed_calls - 80} calls paid twice"


def test_submit_while_postgres_down(sim, workers, own_pg, api_server):
    """POST /v1/batches while PostgreSQL is unreachable: a clear JSON 503 with
    Retry-After, and nothing stored, not even part of the batch. The same request
    (same Idempotency-Key) once it is back is stored once and runs once."""
    key = make_tenant("pgdown")
    auth = {"Authorization": f"Bearer {key}", "Idempotency-Key": "pgdown-1"}
    body = jsonl([chat_line(f"pgdown-{i}") for i in range(20)])
    api = api_server({"DATABASE_URL": own_pg.proxied_url})
    assert http_client.get(f"{api}/v1/batches", headers=auth, timeout=30).status_code == 200
    closed = own_pg.proxy.cut()
    try:
        refused = http_client.post(f"{api}/v1/batches", content=body, headers=auth, timeout=60)
    finally:
        own_pg.proxy.restore()

    assert closed > 0, "the API server's connections did not go through the proxy"
    with db.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Batch)) == 0
        assert s.scalar(select(func.count()).select_from(Item)) == 0
    assert refused.status_code == 503, refused.text[:300]
    assert refused.headers["content-type"].startswith("application/json"), refused.text[:300]
    error = refused.json()["error"]
    assert error["code"] and error["message"]
    assert int(refused.headers["Retry-After"]) >= 1

    accepted = http_client.post(f"{api}/v1/batches", content=body, headers=auth, timeout=60)
    assert accepted.status_code == 200, accepted.text[:300]
    batch_id = accepted.json()["id"]
    workers(env=own_pg.worker_env(), name="worker")
    wait_batches([batch_id], timeout_s=120)
    with db.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Batch)) == 1
    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": 20}
