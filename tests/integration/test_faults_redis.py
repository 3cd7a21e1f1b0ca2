"""Redis faults, injected mid-run into a Redis server of this module's own (broker,
budgets and slots of its workers): SIGKILL and a restart empty, FLUSHALL, a 20 s
pause (SIGSTOP), and a submit while Redis is down.

Each test first proves that its fault really hit, then checks the shared
invariants (:func:`tests.invariants.check_invariants`). PostgreSQL is the
session's; the shared Redis is never touched.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select

from batchgen.embedded import RedisServer, free_port
from batchgen.store import db
from batchgen.store.schema import Batch, Item
from batchgen.worker.procs import WorkerProcess
from tests import http_client
from tests.helpers import (
    FAULT_ENV,
    FAULT_RUNNING_LEASE_S,
    chat_line,
    jsonl,
    make_tenant,
    sim_config,
    status_summary,
    submit_items,
    succeeded_items,
    wait_batches,
    wait_mid_run,
)
from tests.invariants import check_invariants, reset_simulator, wait_until
from tests.waiting import hold

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REDIS_SOCKET_TIMEOUT_S = 5  # batchgen.limits.backend
PAUSE_S = 20
DOWN_S = 3


class OwnRedis:
    """A redis-server of this module's own that tests may kill, restart, flush, pause."""

    def __init__(self, directory: Path) -> None:
        self.server = RedisServer(free_port(), directory)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def pid(self) -> int:
        assert self.server.process is not None
        return self.server.process.pid

    def client(self, **kw: Any) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kw)

    def running(self) -> bool:
        return self.server.process is not None and self.server.process.poll() is None

    def start(self) -> None:
        self.server.start()

    def kill(self) -> None:
        """SIGKILL: no shutdown, nothing saved (it keeps nothing on disk anyway)."""
        assert self.server.process is not None
        os.kill(self.pid, signal.SIGCONT)  # in case a test left it stopped
        self.server.process.kill()
        self.server.process.wait()

    def answers(self) -> bool:
        try:
            return bool(self.client(socket_timeout=1, socket_connect_timeout=1).ping())
        except redis.RedisError:
            return False

    def env(self) -> dict[str, str]:
        """Worker environment: this server as broker, budget and slot store."""
        return {**FAULT_ENV, "REDIS_URL": self.url, "CELERY_BROKER_URL": self.url}


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path_factory.mktemp("own-redis"))
    server.start()
    yield server
    if server.running():
        server.kill()


@pytest.fixture
def own_redis(module_redis: OwnRedis) -> OwnRedis:
    """The module's Redis, running and empty."""
    if not module_redis.running():
        module_redis.start()
    module_redis.client().flushall()
    return module_redis


@pytest.fixture
def sim(simulator: Any, clean_db: dict[str, str]) -> Iterator[Any]:
    reset_simulator(simulator.base_url)
    yield simulator
    sim_config(simulator.base_url, latency_base_ms=50)


def _wait_supervised(
    batch_id: str, worker: WorkerProcess, start: Callable[[str], WorkerProcess]
) -> int:
    """Wait for the batch to end, restarting the worker whenever it has exited, as the
    deployment's ``restart: unless-stopped`` does: a Celery 5.7 worker can die with
    "Unrecoverable error" when its Redis broker is killed. Returns the restarts."""
    restarts = 0

    def finished() -> bool:
        nonlocal restarts, worker
        with db.session_scope() as s:
            if s.scalar(select(Batch.finished_at).where(Batch.id == batch_id)) is not None:
                return True
        if worker.process.poll() is not None:
            restarts += 1
            worker = start(f"{worker.name}-restarted")
        return False

    wait_until(finished, 150, lambda: f"the batch to finish: {status_summary()}", poll_s=0.2)
    return restarts


def _broker_messages(r: redis.Redis) -> int:
    """Messages waiting in the model queues or delivered and not yet acknowledged."""
    return int(r.llen("llm.sim") + r.hlen("unacked"))


def test_redis_sigkill_and_restart_empty(sim, workers, own_redis):
    """Redis is SIGKILLed mid-run and restarted empty on the same port: broker
    messages, budgets and slots are gone; PostgreSQL still knows every item."""
    sim_config(sim.base_url, latency_base_ms=300)
    batch_id = submit_items("rkill", 100)
    start = partial(workers, env=own_redis.env())
    worker = start(name="worker")
    wait_mid_run(sim.base_url, batch_id)
    held_keys = own_redis.client().dbsize()
    old_pid = own_redis.pid
    own_redis.kill()
    done_at_kill = succeeded_items(batch_id)
    # Lost: it says so, or (Celery 5.7's "Unrecoverable error") it has exited. Its
    # threads may first sit out their Redis time-outs in the gate's scripts.
    wait_until(
        lambda: (
            "Connection to broker lost" in worker.log_tail(1_000_000)
            or worker.process.poll() is not None
        ),
        90,
        lambda: f"the worker to lose its broker: {worker.log_tail(40)}",
    )
    own_redis.start()
    _wait_supervised(batch_id, worker, lambda name: start(name=name))

    assert held_keys > 0 and own_redis.pid != old_pid
    assert done_at_kill < 100, "the run was over before the kill"
    report = check_invariants(sim.base_url, own_redis.client(), slot_grace_s=FAULT_RUNNING_LEASE_S)
    assert report.statuses == {"succeeded": 100}


def test_redis_flushall_mid_run(sim, workers, own_redis):
    """FLUSHALL mid-run: queued messages, unacknowledged deliveries, budgets, slots
    and Celery's bindings vanish at once; the sweep re-releases from PostgreSQL."""
    sim_config(sim.base_url, latency_base_ms=300)
    batch_id = submit_items("rflush", 100)
    start = partial(workers, env=own_redis.env())
    worker = start(name="worker")
    wait_mid_run(sim.base_url, batch_id)
    r = own_redis.client()
    messages = wait_until(lambda: _broker_messages(r), 30, "messages in the broker")
    assert r.flushall()
    done_at_flush = succeeded_items(batch_id)
    _wait_supervised(batch_id, worker, lambda name: start(name=name))

    assert messages > 0 and done_at_flush < 100
    report = check_invariants(sim.base_url, r, slot_grace_s=FAULT_RUNNING_LEASE_S)
    assert report.statuses == {"succeeded": 100}


def test_redis_paused_20s(sim, workers, own_redis):
    """Redis stops answering for 20 s (SIGSTOP, then SIGCONT) with calls in flight:
    connections stay open but nothing answers, so every Redis call of the workers
    (broker, budget, slots) hangs or times out. 20 s is longer than the Redis client's
    socket time-out (5 s) and the running lease of this test (7 s)."""
    sim_config(sim.base_url, latency_base_ms=300)
    batch_id = submit_items("rpause", 100)
    start = partial(workers, env=own_redis.env())
    worker = start(name="worker")
    wait_mid_run(sim.base_url, batch_id)
    os.kill(own_redis.pid, signal.SIGSTOP)
    try:
        paused_at = time.monotonic()
        done_at_pause = succeeded_items(batch_id)
        answered = own_redis.answers()
        hold(PAUSE_S - (time.monotonic() - paused_at), "Redis stays paused")
    finally:
        os.kill(own_redis.pid, signal.SIGCONT)
    _wait_supervised(batch_id, worker, lambda name: start(name=name))

    assert not answered, "Redis still answered while stopped"
    assert done_at_pause < 100, "the run was over before the pause"
    report = check_invariants(sim.base_url, own_redis.client(), slot_grace_s=FAULT_RUNNING_LEASE_S)
    assert report.statuses == {"succeeded": 100}


def test_submit_while_redis_down(sim, workers, own_redis, api_server):
    """POST /v1/batches while the broker is down: PostgreSQL is the store, so the batch
    is stored and the client is told so (200 with its id); waking the dispatcher is
    best effort. Once Redis is back (empty), the batch runs to the end."""
    key = make_tenant("rdown")
    api = api_server(own_redis.env())
    own_redis.kill()
    lines = [chat_line(f"rdown-{i}") for i in range(50)]
    response = http_client.post(
        f"{api}/v1/batches",
        content=jsonl(lines),
        headers={"Authorization": f"Bearer {key}", "Idempotency-Key": "rdown-1"},
        timeout=60,
    )

    assert response.status_code == 200, response.text
    batch_id = response.json()["id"]
    with db.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Batch)) == 1
        assert s.scalar(select(Batch.total_items).where(Batch.id == batch_id)) == 50
        assert s.scalar(select(func.count()).select_from(Item)) == 50

    own_redis.start()
    workers(env=own_redis.env(), name="worker")
    wait_batches([batch_id], timeout_s=120)
    told = http_client.get(
        f"{api}/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {key}"}, timeout=30
    ).json()
    assert told["request_counts"]["succeeded"] == 50
    report = check_invariants(sim.base_url, own_redis.client())
    assert report.statuses == {"succeeded": 50}


def test_workers_survive_a_redis_kill_and_restart_unsupervised(sim, workers, own_redis):
    """Redis is SIGKILLed mid-run and restarted on the same port, with nothing to
    restart a worker that exits: both workers must reconnect on their own (the
    redis transport's restore of unacknowledged messages at the connection loss used to
    raise AttributeError on a released connection and end them), and every item ends
    exactly once."""
    sim_config(sim.base_url, latency_base_ms=1000)
    start = partial(workers, env=own_redis.env())
    # As `batchgen worker` runs them: with Celery's gossip and mingle steps.
    pair = [start(name="worker-a", gossip=True), start(name="worker-b", beat=False, gossip=True)]
    batch_id = submit_items("rkill2", 120)
    wait_mid_run(sim.base_url, batch_id)
    own_redis.kill()
    done_at_kill = succeeded_items(batch_id)
    wait_until(
        lambda: any("Connection to broker lost" in w.log_tail(1_000_000) for w in pair),
        30,
        "a worker to lose its broker",
    )
    hold(DOWN_S, "calls in flight end (and ack) while the broker is away")
    own_redis.start()
    wait_batches([batch_id], timeout_s=90)

    exited = {w.name: w.process.poll() for w in pair if w.process.poll() is not None}
    assert not exited, f"workers exited: {exited}"
    assert done_at_kill < 120, "the run was over before the kill"
    report = check_invariants(sim.base_url, own_redis.client(), slot_grace_s=FAULT_RUNNING_LEASE_S)
    assert report.statuses == {"succeeded": 120}
