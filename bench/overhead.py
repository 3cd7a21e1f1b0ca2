"""What one item costs batchgen (CPU, PostgreSQL transactions, Redis commands) against a
Celery task that does nothing, side by side in one run.

Same machine set-up for both runs: PostgreSQL and Redis (embedded, or the given
``DATABASE_URL`` / ``REDIS_URL`` in a database of their own), the provider
simulator in its own process answering at once (zero latency, no limits), and
``--workers`` Celery worker processes × ``--threads`` threads (thread pool; ``--pool gevent``
for greenlets through bench/gevent_worker.py, in both runs):

  (a) no-op: N messages of a task that does nothing (bench/noop_tasks.py, on
      batchgen's broker and Celery settings), published up front by this
      process, drained by the workers;
  (b) batchgen: N items submitted through ``batchgen.python_api.submit_batch``
      (one batch per tenant), drained to all succeeded by the workers (queue
      ``llm.<group>``) and the dispatcher process (``batchgen.control``, beat
      embedded, as ``batchgen dispatcher`` runs it);
  (c) the round-trip floor (``--floor``, after each batchgen run): N messages of a task
      that makes batchgen's per-item round trips and nothing else
      (bench/noop_tasks.py: a Redis script, ``SELECT 1``, the same provider call to
      the simulator through batchgen's adapter, ``SELECT 1``, a Redis script; or
      ``call``: the call and one script), drained like the no-op. What it costs
      above the no-op is the price of the round trips an item needs; what batchgen
      costs above it is batchgen's own work.

Each run first drains ``--warmup`` messages or items, waits ``--settle-s`` (so
PostgreSQL has every earlier count reported), then measures from the first
publish or submit until the last message is acked or every batch is finished:

  CPU       user + system time of every process involved (/proc/<pid>/stat:
            own time plus that of children that ended): worker processes and
            their children, the dispatcher and its beat, redis-server, every
            PostgreSQL process (the postmaster and its children), the
            simulator, and this process (publishing or submitting, polling).
            Printed with every process and without the simulator's (the provider
            side, which a deployment does not run): the target is the latter, at
            most the no-op's (TARGET_CPU_RATIO), and so is the floor's table.
  PostgreSQL  pg_stat_database deltas of the bench database (transactions =
            xact_commit + xact_rollback, rows inserted and updated); read once
            all of the run's processes have stopped and the counts settled,
            minus this bench's own polling queries.
  Redis     INFO commandstats deltas (includes the commands Lua scripts run),
            minus this bench's own INFO and polling commands.

With ``--rounds N`` the two runs alternate N times on the same servers (no-op, batchgen,
no-op, batchgen...): the table is the round whose CPU ratio is the median, and a line
gives every round's ratio, so that a machine whose speed drifts during the runs shows
it instead of deciding the figure (the median by the ratio without the simulator).

    .venv/bin/python bench/overhead.py [--items 2000] [--workers 2] [--threads 16]
                                      [--tenants 1] [--pool threads] [--count-items 300]
                                      [--rounds 1] [--floor trips|call|both|none]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    MODEL_TOML,
    chat_requests,
    parent_pids,
    pg_database_counters,
    postgres_server_pid,
    redis_command_calls,
    redis_server_pid,
    reset_state,
    servers,
    settled_pg_counters,
    simulator_pid,
    simulator_process,
    start_celery_worker,
    tree_cpu_s,
)

MODEL = "bench"
CONTROL_QUEUE = "batchgen.control"
GROUPS = ("workers", "dispatcher", "Redis", "PostgreSQL", "simulator", "bench")
# --floor: which floor tasks run (bench/noop_tasks.py, ``steps``).
FLOORS = {"none": (), "trips": ("trips",), "call": ("call",), "both": ("trips", "call")}
# CPU per item of batchgen's own processes (the simulator's left out: it is the provider
# side, which a real deployment does not run) against the no-op task's (issue 34).
TARGET_CPU_RATIO = 1.0
NO_SIM = ("simulator",)
TARGET_TRANSACTIONS = 3.0
TARGET_REDIS_COMMANDS = 12.0


@dataclass
class Setup:
    """What both runs share: the servers' processes and two monitoring connections."""

    args: argparse.Namespace
    workdir: Path
    sim_url: str
    database: str
    stats_conn: Any  # psycopg, autocommit, on another database of the same server
    redis: Any
    server_pids: dict[str, int | None]
    given_servers: list[str]


@dataclass
class Result:
    label: str
    items: int
    wall_s: float = 0.0
    cpu_s: dict[str, float | None] = field(default_factory=dict)
    pg: dict[str, int] = field(default_factory=dict)
    pg_settled: bool = True
    redis: Counter[str] = field(default_factory=Counter)
    checks: list[str] = field(default_factory=list)
    # The counting pass (MONITOR): commands per source, and per (source, command).
    count_items: int = 0
    redis_sources: Counter[str] = field(default_factory=Counter)
    redis_by_source_command: Counter[tuple[str, str]] = field(default_factory=Counter)

    def per_item(self, value: float | None, scale: float = 1.0) -> float | None:
        return None if value is None else value * scale / self.items

    @property
    def transactions(self) -> int:
        return self.pg.get("xact_commit", 0) + self.pg.get("xact_rollback", 0)

    def cpu_total(self, without: tuple[str, ...] = ()) -> float:
        """The groups' sum (a group whose process was not found is left out, and said)."""
        return sum(v for g, v in self.cpu_s.items() if g not in without and v is not None)


class Meter:
    """Readings at the start and at the end of a measured window."""

    def __init__(self, setup: Setup, roots: dict[str, list[int]]):
        self.setup = setup
        # Server processes count in both runs; a group without processes is left out.
        self.roots = {
            "Redis": setup.server_pids["Redis"],
            "PostgreSQL": setup.server_pids["PostgreSQL"],
            "simulator": setup.server_pids["simulator"],
            **{g: pids for g, pids in roots.items() if pids},
        }
        self.own_redis: Counter[str] = Counter()  # commands this bench sends while measuring

    def _cpu(self) -> dict[str, float | None]:
        parents = parent_pids()
        out: dict[str, float | None] = {}
        for group, roots in self.roots.items():
            pids = roots if isinstance(roots, list) else [roots]
            values = [tree_cpu_s(pid, parents) if pid else None for pid in pids]
            out[group] = None if any(v is None for v in values) else sum(v or 0 for v in values)
        return out

    def start(self) -> None:
        self.pg0 = pg_database_counters(self.setup.stats_conn, self.setup.database)
        self.redis0 = redis_command_calls(self.setup.redis)
        self.own_redis["info"] += 1  # the INFO above counts in the next one
        self.cpu0 = self._cpu()
        self.bench0 = time.process_time()  # last: this reading's own work is not measured
        self.t0 = time.monotonic()

    def stop_clock(self, result: Result, ended_at: float | None = None) -> None:
        result.wall_s = (ended_at or time.monotonic()) - self.t0
        bench = time.process_time() - self.bench0  # first, for the same reason
        cpu1 = self._cpu()
        redis1 = redis_command_calls(self.setup.redis)
        for group, before in self.cpu0.items():
            after = cpu1.get(group)
            result.cpu_s[group] = None if before is None or after is None else after - before
        result.cpu_s["bench"] = bench
        delta = Counter({k: v - self.redis0.get(k, 0) for k, v in redis1.items()})
        delta.subtract(self.own_redis)
        result.redis = Counter({k: v for k, v in delta.items() if v > 0})

    def finish_pg(self, result: Result, own_transactions: int) -> None:
        """Once every process of the run has stopped (each reports its counts at exit)."""
        pg1, result.pg_settled = settled_pg_counters(self.setup.stats_conn, self.setup.database)
        result.pg = {k: pg1[k] - self.pg0[k] for k in pg1 if k != "numbackends"}
        result.pg["xact_commit"] -= own_transactions


def _check_alive(procs: list[Any]) -> None:
    for proc in procs:
        if proc.process.poll() is not None:
            raise RuntimeError(f"worker {proc.name} exited: {proc.log_tail()}")


def _wait(done: Callable[[], bool], procs: list[Any], timeout_s: float, poll_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        _check_alive(procs)
        if time.monotonic() > deadline:
            errors = [
                f"{proc.name}: {line}"
                for proc in procs
                for line in proc.log_tail(200).splitlines()
                if " ERROR " in line or "Traceback" in line
            ]
            raise TimeoutError(
                f"not drained within {timeout_s:g}s; last errors in the worker logs:\n"
                + "\n".join(errors[-5:] or ["(none)"])
            )
        time.sleep(poll_s)


# --- (a) the no-op task ---------------------------------------------------------------


def run_noop(setup: Setup) -> Result:
    from bench import noop_tasks

    return run_baseline(setup, "no-op task", noop_tasks.TASK, noop_tasks.QUEUE)


def run_floor(setup: Setup, steps: str) -> Result:
    from bench import noop_tasks

    setup.redis.delete(noop_tasks.FLOOR_DONE_KEY)
    result = run_baseline(
        setup,
        f"floor ({steps})",
        noop_tasks.FLOOR_TASK,
        noop_tasks.FLOOR_QUEUE,
        {"steps": steps},
    )
    done = int(setup.redis.get(noop_tasks.FLOOR_DONE_KEY) or 0)
    expected = setup.args.items + setup.args.warmup
    result.checks.append(
        f"floor ({steps}): {done} calls got through"
        + ("" if done == expected else f"  ** expected {expected} **")
    )
    return result


def run_baseline(
    setup: Setup, label: str, task: str, queue: str, extra: dict[str, Any] | None = None
) -> Result:
    """N messages of ``task`` (a task of bench/noop_tasks.py) on ``queue``, published up
    front, drained by the workers (``extra``: more keyword arguments of the task)."""
    from batchgen.store import db
    from bench import noop_tasks

    args = setup.args
    result = Result(label, args.items)
    db.get_engine().dispose()  # the migration's connection: reports its counts as it closes
    unacked_key = (noop_tasks.app.conf.broker_transport_options or {}).get("unacked_key", "unacked")
    workers = [
        start_celery_worker(
            "bench.noop_tasks",
            [queue],
            log_dir=setup.workdir / "logs" / queue,
            concurrency=args.threads,
            env={"BATCHGEN_LOG_LEVEL": "WARNING", noop_tasks.FLOOR_ROWS_ENV: str(args.items)},
            name=f"{queue.rsplit('.', 1)[-1]}{i}",
            pool=args.pool,
        )
        for i in range(args.workers)
    ]
    meter = Meter(setup, {"workers": [w.process.pid for w in workers]})
    first_empty: float | None = None

    def drained() -> bool:
        # Waiting in the queue, or delivered and not acked yet (kombu's unacked hash);
        # twice in a row, as a message is in neither for an instant after BRPOP. The
        # first of the two empty reads ends the wall time.
        nonlocal first_empty
        pipe = setup.redis.pipeline(transaction=False)
        pipe.llen(queue)
        pipe.hlen(unacked_key)
        read_at = time.monotonic()
        waiting, unacked = pipe.execute()
        meter.own_redis.update(("llen", "hlen"))
        if waiting or unacked:
            first_empty = None
            return False
        if first_empty is None:
            first_empty = read_at
            return False
        return True

    def publish(n: int) -> None:
        for i in range(n):
            kwargs = {"model": MODEL, **(extra or {})}
            noop_tasks.app.send_task(task, args=[i], kwargs=kwargs, queue=queue)

    try:
        for w in workers:
            w.wait_ready()
        if args.warmup:
            publish(args.warmup)
            _wait(drained, workers, args.timeout_s, 0.02)
        time.sleep(args.settle_s)
        meter.own_redis.clear()
        first_empty = None
        meter.start()
        publish(args.items)
        _wait(drained, workers, args.timeout_s, 0.02)
        meter.stop_clock(result, ended_at=first_empty)
        stats = noop_tasks.app.control.inspect(timeout=2.0).stats() or {}
        ran = sum(s.get("total", {}).get(task, 0) for s in stats.values())
        expected = args.items + args.warmup
        result.checks.append(
            f"{label}: {ran} tasks run by {len(stats)} workers "
            f"({args.warmup} warm-up + {args.items} measured)"
            + ("" if ran == expected else f"  ** expected {expected} **")
        )
    finally:
        for w in workers:
            w.stop()
    meter.finish_pg(result, own_transactions=0)
    return result


# --- (b) batchgen -------------------------------------------------------------------


class BatchesPoll:
    """Polls the bench database for unfinished batches on a connection of its own, in
    autocommit: one transaction per poll, counted so that it can be taken off, plus
    one that PostgreSQL 16 counts when the connection closes after it was used
    (measured: n statements then close → n + 1)."""

    def __init__(self) -> None:
        from sqlalchemy import create_engine
        from sqlalchemy.pool import NullPool

        from batchgen.config import get_settings

        self.engine = create_engine(get_settings().sqlalchemy_url, poolclass=NullPool)
        self.conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        self.polls = 0

    def own_transactions(self) -> int:
        """What the polls since :meth:`restart` count in pg_stat_database once closed."""
        return self.polls + 1 if self.polls else 0

    def restart(self) -> None:
        self.polls = 0

    def unfinished(self, batch_ids: list[str]) -> int:
        from sqlalchemy import func, select

        from batchgen.store.schema import Batch

        self.polls += 1
        return int(
            self.conn.scalar(
                select(func.count())
                .select_from(Batch)
                .where(Batch.id.in_(batch_ids), Batch.finished_at.is_(None))
            )
            or 0
        )

    def close(self) -> None:
        self.conn.close()
        self.engine.dispose()


class CommandCount:
    """Counts the commands Redis runs while it is on (``MONITOR``, on a thread of its
    own), split by who sent them: a client (one round trip each) or a Lua script.
    MONITOR slows Redis down, so it runs in a counting pass of its own, never while
    CPU is measured."""

    def __init__(self, url: str):
        import redis as redis_lib

        self.client = redis_lib.Redis.from_url(url)
        self.by_source: Counter[str] = Counter()
        self.by_command: Counter[tuple[str, str]] = Counter()
        self._monitor = self.client.monitor()
        self._monitor.__enter__()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                command = self._monitor.next_command()
                if command is None:
                    return
                source = "script" if command["client_type"] == "lua" else "client"
                name = command["command"].split(" ", 1)[0].strip('"').lower()
                self.by_source[source] += 1
                self.by_command[(source, name)] += 1
        except Exception:  # the connection closed: counting is over
            return

    def stop(self) -> None:
        time.sleep(0.5)  # the last replies reach the monitor
        self._monitor.__exit__(None, None, None)
        self._thread.join(timeout=5)
        self.client.close()


def count_pass(setup: Setup, procs: list[Any], result: Result) -> None:
    """A smaller batch with MONITOR on, before the measured one: commands per item by
    source."""
    from batchgen import python_api
    from batchgen.config import get_settings

    args = setup.args
    n = args.count_items
    counter = CommandCount(get_settings().redis.url)
    try:
        batch = python_api.submit_batch(
            chat_requests(n, MODEL, "count", seed=2), tenant="bench-warmup"
        )
        poll = BatchesPoll()
        try:
            _wait(lambda: not poll.unfinished([batch["id"]]), procs, args.timeout_s, 0.2)
        finally:
            poll.close()
    finally:
        counter.stop()
    result.count_items = n
    result.redis_sources = counter.by_source
    result.redis_by_source_command = counter.by_command


def run_batchgen(setup: Setup) -> Result:
    from batchgen import python_api
    from batchgen.store import db, tenants
    from batchgen.worker.procs import start_worker

    args = setup.args
    result = Result("batchgen", args.items)
    reset_state(setup.sim_url)
    names = [f"bench-{k}" for k in range(args.tenants)]
    with db.session_scope() as s:
        for name in [*names, "bench-warmup"]:
            tenants.create_tenant(s, name)
    rows = chat_requests(args.items, MODEL, "run")
    per_tenant = [rows[k :: args.tenants] for k in range(args.tenants)]
    env = {"BATCHGEN_LOG_LEVEL": "WARNING"}
    log_dir = setup.workdir / "logs" / "batchgen"
    dispatcher = start_worker(
        [CONTROL_QUEUE],
        log_dir=log_dir,
        concurrency=args.dispatcher_threads,
        beat=True,
        env=env,
        name="dispatcher",
    )
    workers = [
        start_celery_worker(
            "batchgen.tasks",
            [f"llm.{MODEL}"],
            log_dir=log_dir,
            concurrency=args.threads,
            env=env,
            name=f"bg{i}",
            pool=args.pool,
        )
        for i in range(args.workers)
    ]
    procs = [dispatcher, *workers]
    meter = Meter(
        setup,
        {"workers": [w.process.pid for w in workers], "dispatcher": [dispatcher.process.pid]},
    )
    poll = BatchesPoll()
    batch_ids: list[str] = []
    try:
        for p in procs:
            p.wait_ready()
        poll.unfinished([])  # its first use reports before the window (settle)
        if args.warmup:
            warm = python_api.submit_batch(
                chat_requests(args.warmup, MODEL, "warmup", seed=1), tenant="bench-warmup"
            )
            _wait(lambda: not poll.unfinished([warm["id"]]), procs, args.timeout_s, 0.2)
        if args.count_items:  # before the measured window: MONITOR is off by then
            count_pass(setup, procs, result)
        db.get_engine().dispose()  # its connections report their counts as they close
        messages_before = generate_messages_run()
        time.sleep(args.settle_s)
        poll.restart()
        meter.start()
        for name, batch in zip(names, per_tenant, strict=True):
            batch_ids.append(python_api.submit_batch(batch, tenant=name)["id"])
        _wait(lambda: not poll.unfinished(batch_ids), procs, args.timeout_s, 0.2)
        meter.stop_clock(result)
        messages = generate_messages_run() - messages_before
        result.checks.append(
            f"batchgen: {messages} messages of batchgen.generate run for {args.items} items "
            f"({args.items / max(1, messages):.2f} items per message: packs, "
            "app/worker/packs.py)"
        )
    finally:
        poll.close()
        for p in procs:
            p.stop()
        db.get_engine().dispose()
    meter.finish_pg(result, own_transactions=poll.own_transactions())
    counts: Counter[str] = Counter()
    for name, batch_id in zip(names, batch_ids, strict=True):
        counts.update(python_api.get_batch(batch_id, tenant=name)["request_counts"])
    result.checks.append(
        f"batchgen: {counts['succeeded']} of {args.items} items succeeded, "
        f"{counts['failed']} failed, in {len(batch_ids)} batch(es) of {args.tenants} tenant(s)"
        + ("" if counts["succeeded"] == args.items else "  ** not all succeeded **")
    )
    return result


def generate_messages_run() -> int:
    """Messages of the item task the running workers have taken so far (Celery's own
    count, by remote control: outside the measured window)."""
    from batchgen.tasks.celery_app import celery_app
    from batchgen.worker.names import GENERATE_TASK

    stats = celery_app.control.inspect(timeout=2.0).stats() or {}
    return sum(s.get("total", {}).get(GENERATE_TASK, 0) for s in stats.values())


# --- The report ---------------------------------------------------------------------


def code_state() -> str:
    """The commit checked out, and how many product files differ from it (read only)."""
    root = str(Path(__file__).resolve().parent.parent)
    git = ["git", "--no-optional-locks", "-C", root]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--", "app", "tasks", "migrations"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if not head:
        return "unknown (not a git checkout)"
    if changed:
        return f"{head} + {len(changed)} uncommitted file(s) in app/ tasks/ migrations/"
    return head


def _fmt(value: float | None, digits: int = 2, width: int = 11) -> str:
    if value is None:
        return f"{'n/a':>{width}}"
    return f"{value:{width}.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or not b:
        return f"{'n/a':>9}"
    ratio = a / b
    return f"{ratio:8.2f}×" if ratio < 10 else f"{ratio:8.1f}×"


def report(setup: Setup, noop: Result, bg: Result, code: tuple[str, str]) -> None:
    args = setup.args
    print(f"\ncode measured: {code[0]}")
    if code[1] != code[0]:
        print(f"** the code changed during the run: now {code[1]} **")
    print(
        f"{args.items} items/messages; {args.workers} worker processes × {args.threads} "
        f"{'threads (thread pool)' if args.pool == 'threads' else 'greenlets (gevent pool)'}; "
        f"batchgen dispatcher {args.dispatcher_threads} threads + beat; "
        f"{args.tenants} tenant(s); model cap {args.max_concurrency}; simulator at zero latency, "
        f"no limits; warm-up {args.warmup}, settle {args.settle_s:g} s"
    )
    head = f"{'':34} {'no-op task':>11} {'batchgen':>11} {'batchgen/no-op':>15}   target"
    print(head)
    print("-" * len(head))

    def row(label: str, a: str, b: str, ratio: str = "", target: str = "") -> None:
        print(f"{label:34} {a} {b} {ratio:>15}   {target}".rstrip())

    row("wall s", _fmt(noop.wall_s), _fmt(bg.wall_s))
    row(
        "items/s",
        _fmt(noop.items / noop.wall_s, 1),
        _fmt(bg.items / bg.wall_s, 1),
        _ratio(bg.items / bg.wall_s, noop.items / noop.wall_s),
    )
    print("CPU ms per item")
    for group in GROUPS:
        a = noop.per_item(noop.cpu_s[group], 1000) if group in noop.cpu_s else None
        b = bg.per_item(bg.cpu_s[group], 1000) if group in bg.cpu_s else None
        label = {"bench": "bench process (submit/publish)"}.get(group, group)
        row(
            f"  {label}",
            _fmt(a) if group in noop.cpu_s else f"{'-':>11}",
            _fmt(b) if group in bg.cpu_s else f"{'-':>11}",
        )
    total_a, total_b = noop.per_item(noop.cpu_total(), 1000), bg.per_item(bg.cpu_total(), 1000)
    row(
        "  total, all processes",
        _fmt(total_a),
        _fmt(total_b),
        _ratio(total_b, total_a),
        "(the simulator's included)",
    )
    a, b = noop.per_item(noop.cpu_total(NO_SIM), 1000), bg.per_item(bg.cpu_total(NO_SIM), 1000)
    row(
        "  total without the simulator",
        _fmt(a),
        _fmt(b),
        _ratio(b, a),
        f"≤ {TARGET_CPU_RATIO:g}× (provider side left out)",
    )
    print("PostgreSQL per item (bench database)")
    row(
        "  transactions (commit + rollback)",
        _fmt(noop.per_item(noop.transactions)),
        _fmt(bg.per_item(bg.transactions)),
        "",
        f"≤ {TARGET_TRANSACTIONS:g}",
    )
    row(
        "    of which rollbacks",
        _fmt(noop.per_item(noop.pg.get("xact_rollback"))),
        _fmt(bg.per_item(bg.pg.get("xact_rollback"))),
    )
    for key, label in (("tup_inserted", "inserted"), ("tup_updated", "updated")):
        row(f"  rows {label}", _fmt(noop.per_item(noop.pg[key])), _fmt(bg.per_item(bg.pg[key])))
    if noop.pg.get("tup_deleted") or bg.pg.get("tup_deleted"):
        row(
            "  rows deleted",
            _fmt(noop.per_item(noop.pg["tup_deleted"])),
            _fmt(bg.per_item(bg.pg["tup_deleted"])),
        )
    print("Redis commands per item (INFO commandstats)")
    redis_a, redis_b = noop.per_item(sum(noop.redis.values())), bg.per_item(sum(bg.redis.values()))
    row("  total", _fmt(redis_a), _fmt(redis_b), "", f"≤ {TARGET_REDIS_COMMANDS:g}")
    row(
        "  minus the no-op's per message",
        f"{'':11}",
        _fmt(None if redis_a is None or redis_b is None else redis_b - redis_a),
        "",
        "(batchgen's own share)",
    )
    top = sorted(set(bg.redis) | set(noop.redis), key=lambda k: (-bg.redis[k], -noop.redis[k]))
    shown, rest = top[: args.top_commands], top[args.top_commands :]
    for name in shown:
        row(f"    {name}", _fmt(noop.per_item(noop.redis[name])), _fmt(bg.per_item(bg.redis[name])))
    if rest:
        row(
            f"    {len(rest)} other commands",
            _fmt(noop.per_item(sum(noop.redis[k] for k in rest))),
            _fmt(bg.per_item(sum(bg.redis[k] for k in rest))),
        )
    if bg.count_items:
        _report_sources(noop, bg, row)
    print()
    for check in noop.checks + bg.checks:
        print(check)
    for r in (noop, bg):
        if not r.pg_settled:
            print(f"** {r.label}: PostgreSQL counts still moving at the deadline (autovacuum?) **")
    for name, pid in setup.server_pids.items():
        if pid is None:
            print(f"** {name}: no local process found; its CPU is n/a and out of the totals **")
    if args.settle_s < 10.5:
        print("note: --settle-s under 10.5 s: counts PostgreSQL reports late may land in a window")
    for name in setup.given_servers:
        print(f"note: {name} was given, not embedded: its CPU and counters include other clients")


def _report_sources(noop: Result, bg: Result, row: Callable[..., None]) -> None:
    """Round trips (commands clients sent) apart from what scripts ran inside Redis."""
    n = bg.count_items
    print(f"Redis commands per item by source (MONITOR, a counting pass of {n} items first)")
    client, inside = bg.redis_sources["client"] / n, bg.redis_sources["script"] / n
    celery = noop.per_item(sum(noop.redis.values()))  # Celery runs no scripts
    row("  sent by clients (round trips)", _fmt(celery), _fmt(client))
    own = None if celery is None else client - celery
    row(
        "  minus the no-op's per message",
        f"{'':11}",
        _fmt(own),
        "",
        f"≤ {TARGET_REDIS_COMMANDS:g} (batchgen's own)",
    )
    row("  run inside Lua scripts", f"{'-':>11}", _fmt(inside))
    sent = Counter({k: v for (src, k), v in bg.redis_by_source_command.items() if src == "client"})
    for name, calls in sent.most_common(8):
        row(f"    {name}", f"{'':11}", _fmt(calls / n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=2000, help="items and no-op messages")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--threads", type=int, default=16, help="threads per worker process")
    parser.add_argument("--dispatcher-threads", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=1, help="batchgen: one batch each")
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=0,
        help="the model's max_concurrency in the registry; default workers × threads",
    )
    parser.add_argument("--warmup", type=int, default=64, help="drained before measuring")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=11.0,
        help="wait before measuring (an idle PostgreSQL backend reports within 10 s)",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per drain")
    parser.add_argument("--top-commands", type=int, default=14)
    parser.add_argument(
        "--pool",
        choices=("threads", "gevent"),
        default="threads",
        help="the Celery pool of both runs' workers (gevent: bench/gevent_worker.py)",
    )
    parser.add_argument(
        "--count-items",
        type=int,
        default=300,
        help="items of the counting pass (MONITOR on, after the measured one); 0: none",
    )
    parser.add_argument(
        "--floor",
        choices=sorted(FLOORS),
        default="trips",
        help="the round-trip floor runs after each round's batchgen (bench/noop_tasks.py)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="no-op/batchgen pairs run in turn (median shown)"
    )
    args = parser.parse_args()
    if not 1 <= args.rounds <= 20:
        parser.error("--rounds must be between 1 and 20")
    if not 1 <= args.items <= 200_000:
        parser.error("--items must be between 1 and 200000")
    if not 1 <= args.tenants <= min(args.items, 100) or args.items / args.tenants > 50_000:
        parser.error("--tenants: 1 to 100, at most 50000 items each")
    if not (1 <= args.workers <= 16 and 1 <= args.threads <= 256):
        parser.error("--workers 1 to 16, --threads 1 to 256")
    if not 0 <= args.warmup <= 10_000:
        parser.error("--warmup must be between 0 and 10000")
    args.max_concurrency = args.max_concurrency or args.workers * args.threads

    import psycopg
    from redis import Redis
    from sqlalchemy.engine import make_url

    from batchgen.config import get_settings
    from batchgen.embedded import with_database

    given = [name for name in ("DATABASE_URL", "REDIS_URL") if os.environ.get(name)]
    code_before = code_state()
    with (
        servers() as workdir,
        simulator_process("--latency-ms", "0", "--per-token-ms", "0", "--jitter-ms", "0") as sim,
    ):
        models_file = workdir / "models.toml"
        models_file.write_text(
            MODEL_TOML.format(
                name=MODEL,
                base_url=sim,
                tpm=10**12,
                rpm=10**10,
                concurrency=args.max_concurrency,
            )
        )
        os.environ["BATCHGEN_MODELS_FILE"] = str(models_file)
        get_settings.cache_clear()
        url = os.environ["DATABASE_URL"]
        stats_conn, stats_url = None, ""
        for other in ("postgres", "template1"):
            try:
                stats_url = with_database(url, other)
                stats_conn = psycopg.connect(stats_url, autocommit=True)
                break
            except psycopg.Error:
                continue
        if stats_conn is None:
            raise RuntimeError("cannot connect to the postgres or template1 database")
        settings = get_settings()
        if settings.broker_url != settings.redis.url:
            given.append("a broker other than REDIS_URL (its commands are not counted)")
        redis = Redis.from_url(str(settings.redis.url))
        redis.ping()
        setup = Setup(
            args=args,
            workdir=workdir,
            sim_url=sim,
            database=str(make_url(url).database),
            stats_conn=stats_conn,
            redis=redis,
            server_pids={
                "Redis": redis_server_pid(redis),
                "PostgreSQL": postgres_server_pid(stats_url),
                "simulator": simulator_pid(sim),
            },
            given_servers=given,
        )
        rounds: list[tuple[Result, Result]] = []
        floors: list[list[Result]] = []
        try:
            for _ in range(args.rounds):
                rounds.append((run_noop(setup), run_batchgen(setup)))
                floors.append([run_floor(setup, steps) for steps in FLOORS[args.floor]])
                args.count_items = 0  # the counting pass: once, in the first round
        except BaseException:
            print(f"worker logs kept in {workdir / 'logs'}", file=sys.stderr)
            raise
        finally:
            stats_conn.close()
            redis.close()
    shutil.rmtree(workdir, ignore_errors=True)  # the servers' data and the logs
    ratios = [cpu_ratio(noop, bg, NO_SIM) for noop, bg in rounds]
    median = sorted(range(len(rounds)), key=lambda k: ratios[k])[len(rounds) // 2]
    noop, bg = rounds[median]
    if len(rounds) > 1:
        bg.count_items = rounds[0][1].count_items
        bg.redis_sources = rounds[0][1].redis_sources
        bg.redis_by_source_command = rounds[0][1].redis_by_source_command
    report(setup, noop, bg, (code_before, code_state()))
    if len(rounds) > 1:
        each = ", ".join(f"{r:.2f}×" for r in ratios)
        print(f"CPU per item ÷ the no-op's, without the simulator, by round: {each}")
        each = ", ".join(f"{cpu_ratio(noop, bg):.2f}×" for noop, bg in rounds)
        print(f"CPU per item ÷ the no-op's, all processes, by round: {each}")
        print(f"the table above is round {median + 1} of {len(rounds)} (the median ratio)")
    if args.floor != "none":
        report_floor(floors, rounds)


def report_floor(floors: list[list[Result]], rounds: list[tuple[Result, Result]]) -> None:
    """Each round's floor runs beside that round's no-op and batchgen (CPU per item, all
    processes)."""
    print(
        "\nThe round-trip floor (bench/noop_tasks.py): a task that makes batchgen's per-item "
        "round trips and nothing else,\nrun after each round's batchgen. trips: Redis script, "
        "SELECT 1, the same provider call, SELECT 1, Redis script; call: the call and one "
        "script"
    )
    groups = ("workers", "Redis", "PostgreSQL", "simulator")
    print(
        f"{'round':>5} {'floor':>6} {'simulator':>9}   {'CPU ms per item: no-op':>22} "
        f"{'floor':>6} {'batchgen':>9}  "
        + " ".join(f"{g[:10]:>10}" for g in groups)
        + "   floor/no-op  batchgen/floor  PG tx/item"
    )
    for k, (runs, (noop, bg)) in enumerate(zip(floors, rounds, strict=True), start=1):
        for floor in runs:
            parts = " ".join(_fmt(floor.per_item(floor.cpu_s.get(g), 1000), 2, 10) for g in groups)
            for sim, without in (("with", ()), ("without", NO_SIM)):
                per = [r.cpu_total(without) * 1000 / r.items for r in (noop, floor, bg)]
                print(
                    f"{k:5d} {floor.label[7:-1]:>6} {sim:>9}   {per[0]:22.2f} {per[1]:6.2f} "
                    f"{per[2]:9.2f}  {parts}   {per[1] / per[0]:10.2f}×  "
                    f"{per[2] / per[1]:13.2f}×  {floor.per_item(floor.transactions) or 0:10.2f}"
                )
    for floor in floors[0]:
        for check in floor.checks:
            print(check)


def cpu_ratio(noop: Result, bg: Result, without: tuple[str, ...] = ()) -> float:
    """CPU per item of every process (but the groups ``without``), batchgen's ÷ the
    no-op's."""
    return (bg.cpu_total(without) / bg.items) / (noop.cpu_total(without) / noop.items)


if __name__ == "__main__":
    main()
