"""Shared pieces of the benchmarks: real servers, a simulator process, workers.

Benchmarks run on embedded PostgreSQL and Redis (or the given URLs, in a
database of their own), a simulator in its own process, and real Celery
worker processes, and print ratios measured side by side in one run.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]

MODEL_TOML = """
[models."{name}"]
provider = "openai"
base_url = "{base_url}/v1"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "{name}"
budget_key = "{name}-account"
context_window = 16384
max_output_tokens = 400
tokens_per_min = {tpm}
requests_per_min = {rpm}
max_concurrency = {concurrency}
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0
encoding = "cl100k_base"
charge_policy = "reserve"
max_attempts = 50
"""


@contextlib.contextmanager
def servers() -> Iterator[Path]:
    """Embedded (or given) PostgreSQL and Redis, a fresh database, migrated."""
    from batchgen import embedded
    from batchgen.config import get_settings
    from batchgen.store import db

    workdir = Path(tempfile.mkdtemp(prefix="batchgen-bench-"))
    with embedded.services(workdir / "data") as urls:
        name = f"batchgen_bench_{os.getpid()}"
        embedded.drop_database(urls["DATABASE_URL"], name)
        os.environ["DATABASE_URL"] = embedded.ensure_database(urls["DATABASE_URL"], name)
        get_settings.cache_clear()
        db.upgrade()
        try:
            yield workdir
        finally:
            db.get_engine().dispose()
            embedded.drop_database(urls["DATABASE_URL"], name)


@contextlib.contextmanager
def simulator_process(*args: str) -> Iterator[str]:
    """``python -m batchgen.simulator`` on a free port; yields its base URL."""
    from batchgen.embedded import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchgen.simulator",
            "--port",
            str(port),
            "--log-level",
            "WARNING",
            *args,
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{url}/_sim/stats", timeout=0.5).raise_for_status()
                break
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def api_process(env: dict[str, str], log_path: Path) -> Iterator[tuple[str, int]]:
    """``batchgen api`` on a free port with ``env``; yields its base URL and pid."""
    import signal

    from batchgen.embedded import free_port

    port = free_port()
    argv = [sys.executable, "-m", "batchgen.cli", "api", "--host", "127.0.0.1"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*argv, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(400):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200:
                    break
            time.sleep(0.05)
        yield url, proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


def live_model_env(
    workdir: Path, model: str, sim_url: str, concurrency: int, **extra: str
) -> dict[str, str]:
    """Write a registry of one unlimited model on the simulator (``concurrency`` slots)
    and put the environment every process of the bench shares into ``os.environ``
    (``extra``: more variables); returns that environment."""
    from batchgen.config import get_settings

    models_file = workdir / "models.toml"
    models_file.write_text(
        MODEL_TOML.format(
            name=model,
            base_url=sim_url,
            tpm=1_000_000_000,
            rpm=1_000_000_000,
            concurrency=concurrency,
        )
    )
    env = {
        "BATCHGEN_MODELS_FILE": str(models_file),
        "BATCHGEN_SIMULATOR_KEY": "bench",
        "DATABASE_URL": os.environ["DATABASE_URL"],
        "REDIS_URL": os.environ.get("REDIS_URL", get_settings().redis.url or ""),
        "CELERY_BROKER_URL": os.environ.get("CELERY_BROKER_URL", get_settings().broker_url),
        **extra,
    }
    os.environ.update(env)
    get_settings.cache_clear()
    return env


def reset_state(sim_url: str | None) -> None:
    """Empty tables, an empty Redis and a fresh simulator (None: no simulator) between
    runs.

    The previous run's calls are let finish first; TRUNCATE then takes its
    table locks (retried if a worker's transaction still holds one).
    """
    from sqlalchemy.exc import OperationalError

    from batchgen.limits.backend import get_redis
    from batchgen.store.db import get_engine

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with get_engine().connect() as conn:
            busy = conn.execute(
                text("SELECT count(*) FROM items WHERE status IN ('queued', 'running')")
            ).scalar()
        if not busy:
            break
        time.sleep(0.5)
    for attempt in range(10):
        try:
            with get_engine().begin() as conn:
                conn.execute(
                    text(
                        "TRUNCATE tenant_daily_usage, usage_ledger, results, "
                        "provider_job_items, items, provider_jobs, batches, admitted_totals, "
                        "finished_totals, batch_totals, latency_totals, tenants "
                        "RESTART IDENTITY CASCADE"
                    )
                )
                conn.execute(text("UPDATE totals_watermark SET rolled_up_before = NULL"))
            break
        except OperationalError:
            if attempt == 9:
                raise
            time.sleep(0.5)
    get_redis().flushdb()
    if sim_url is not None:
        httpx.post(f"{sim_url}/_sim/reset").raise_for_status()


def chat_requests(n: int, model: str, prefix: str, seed: int = 0) -> list[dict[str, Any]]:
    """Mixed prompt lengths (1-150 words) and max_tokens (20-200)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 150)))
        rows.append(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "max_tokens": rng.randint(20, 200),
                    "messages": [{"role": "user", "content": f"{prefix} {i}: {words}"}],
                },
            }
        )
    return rows


def wait_finished(batch_ids: list[str], timeout_s: float) -> None:
    from sqlalchemy import func, select

    from batchgen.store.db import session_scope
    from batchgen.store.schema import Batch

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with session_scope() as s:
            open_ = s.scalar(
                select(func.count())
                .select_from(Batch)
                .where(Batch.id.in_(batch_ids), Batch.finished_at.is_(None))
            )
        if not open_:
            return
        time.sleep(0.5)
    raise TimeoutError(f"batches not finished within {timeout_s}s")


# --- Process CPU, server processes and server counters (bench/overhead.py) ---------------


def start_celery_worker(
    app: str,
    queues: list[str],
    *,
    log_dir: Path,
    concurrency: int,
    env: dict[str, str] | None = None,
    name: str,
    pool: str | None = None,
    beat: bool = False,
) -> Any:
    """``celery -A <app> worker`` for a Celery app of the benchmarks (``bench.…``), started
    like :func:`batchgen.worker.procs.start_worker` starts batchgen's: the same pool and
    options, its own process group, and a ready file the app's ``worker_ready`` handler
    touches (``BATCHGEN_READY_FILE``); returns a ``WorkerProcess``.

    ``pool="gevent"`` starts it through ``bench/gevent_worker.py`` (batchgen refuses
    that pool otherwise), to measure it against the thread pool."""
    from batchgen.worker.procs import WORKER_POOL, WorkerProcess

    pool = pool or WORKER_POOL
    launcher = [str(Path(__file__).with_name("gevent_worker.py"))]
    launcher = launcher if pool == "gevent" else ["-m", "celery"]

    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    ready_path = log_dir / f"{name}.ready"
    ready_path.unlink(missing_ok=True)
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    argv = [
        sys.executable,
        *launcher,
        "-A",
        app,
        "worker",
        "-Q",
        ",".join(queues),
        "-P",
        pool,
        "-c",
        str(concurrency),
        "-n",
        f"{name}@%h",
        "--without-mingle",
        "--without-gossip",
        "--loglevel",
        "INFO",
    ]
    if beat:
        argv += ["-B", "-s", str(log_dir / f"{name}-beat-schedule")]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                **(env or {}),
                "PYTHONPATH": path,
                "BATCHGEN_READY_FILE": str(ready_path),
            },
            start_new_session=True,
        )
    return WorkerProcess(name, process, log_path, ready_path)


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the state on (field 3 is index 0)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def _proc_comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def parent_pids() -> dict[int, int]:
    """Every live process (zombies included) and its parent, from ``/proc``."""
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _proc_stat(int(entry.name))
            if fields:
                parents[int(entry.name)] = int(fields[1])
    return parents


def process_tree(root: int, parents: dict[int, int] | None = None) -> list[int]:
    """``root`` and all its descendants alive now (``[]`` when ``root`` is gone)."""
    parents = parent_pids() if parents is None else parents
    if root not in parents:
        return []
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def tree_cpu_s(root: int, parents: dict[int, int] | None = None) -> float | None:
    """CPU seconds (user + system, every thread) used so far by ``root`` and its
    descendants: each live process's own time (utime, stime) plus what it collected
    from children that ended and it waited for (cutime, cstime), so a process that
    ends between two readings still counts. ``None`` when ``root`` is gone."""
    pids = process_tree(root, parents)
    if not pids:
        return None
    ticks = 0
    for pid in pids:
        fields = _proc_stat(pid)
        if fields:
            ticks += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    return ticks / CLOCK_TICKS


def postgres_server_pid(url: str) -> int | None:
    """The postmaster of the PostgreSQL at ``url`` when it runs on this machine (the
    topmost ``postgres`` process above our own backend), else ``None``."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        pid, found = int(row[0]) if row else 0, None
        while pid > 1 and _proc_comm(pid) in ("postgres", "postmaster"):
            found = pid
            fields = _proc_stat(pid)
            pid = int(fields[1]) if fields else 0
    return found


def redis_server_pid(client: Any) -> int | None:
    """The redis-server process behind ``client`` when it runs on this machine."""
    pid = int(client.info("server")["process_id"])
    return pid if (_proc_comm(pid) or "").startswith("redis") else None


def simulator_pid(url: str) -> int | None:
    """The process :func:`simulator_process` started for ``url`` (a child of ours)."""
    from urllib.parse import urlsplit

    port = str(urlsplit(url).port).encode()
    me = os.getpid()
    for pid, ppid in parent_pids().items():
        if ppid != me:
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"batchgen.simulator" in argv and port in argv:
            return pid
    return None


def redis_command_calls(client: Any) -> dict[str, int]:
    """Calls per command since the server started (``INFO commandstats``). Redis counts
    the commands a Lua script runs (``redis.call``) as well as the EVALSHA itself."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


PG_COUNTERS = ("xact_commit", "xact_rollback", "tup_inserted", "tup_updated", "tup_deleted")


def pg_database_counters(conn: Any, database: str) -> dict[str, int]:
    """``pg_stat_database`` counters of ``database`` (``conn``: psycopg, autocommit,
    best on another database so that reading does not count). Backends report their
    counts when they end a transaction and go idle, at most once a second (an idle
    backend within 10 s), and when they exit: read again until they stop moving."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        f"SELECT {', '.join(PG_COUNTERS)}, numbackends FROM pg_stat_database WHERE datname = %s",
        (database,),
    ).fetchone()
    values = dict(zip((*PG_COUNTERS, "numbackends"), (int(v or 0) for v in row), strict=True))
    return values


def settled_pg_counters(
    conn: Any, database: str, quiet_s: float = 1.5, timeout_s: float = 30.0
) -> tuple[dict[str, int], bool]:
    """The counters once no backend is connected to ``database`` (they report at exit)
    and nothing moved for ``quiet_s``; ``(counters, settled)``, ``settled`` False when
    ``timeout_s`` ran out first."""
    deadline = time.monotonic() + timeout_s
    last = pg_database_counters(conn, database)
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = pg_database_counters(conn, database)
        if now != last or now["numbackends"]:
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return now, True
    return last, False
