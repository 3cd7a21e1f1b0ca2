"""Faults of the worker side, injected mid-run: killed worker processes, a warm
shutdown with calls in flight, a killed dispatcher, forged and non-JSON broker
messages, and budget waits longer than the broker's visibility timeout.

Each test first proves that its fault really hit, then checks the shared
invariants (:func:`tests.invariants.check_invariants`) against the simulator's
own request log. Servers: the session's PostgreSQL and Redis; worker processes
of their own per test; the simulator over HTTP.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from kombu import Connection, Producer
from sqlalchemy import select

from batchgen import python_api as client
from batchgen.limits.backend import get_redis
from batchgen.registry import get_registry
from batchgen.store import db
from batchgen.store.schema import Item
from batchgen.worker.procs import WorkerProcess
from tests import http_client
from tests.helpers import (
    FAULT_ENV,
    FAULT_RUNNING_LEASE_S,
    chat_line,
    make_tenant,
    models_file_with,
    sim_config,
    sim_in_flight,
    submit_items,
    succeeded_items,
    wait_batches,
    wait_mid_run,
)
from tests.invariants import check_invariants, cut_calls, reset_simulator, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONTROL_QUEUE = "batchgen.control"
SLOW_CALL_MS = 300  # long enough that a fault lands while calls are in flight
SURVIVOR_THREADS = 4


@pytest.fixture
def sim(simulator: Any, clean_db: dict[str, str]) -> Iterator[Any]:
    """The module's simulator with an empty request log (item ids restart per test)."""
    reset_simulator(simulator.base_url)
    yield simulator
    sim_config(simulator.base_url, latency_base_ms=50)


def _ready(*procs: WorkerProcess) -> None:
    """Wait for workers started together (``wait=False``): their start-ups overlap."""
    for p in procs:
        p.wait_ready()


def _llm_queues() -> list[str]:
    return list(get_registry().queues)


def _group_alive(pgid: int) -> list[psutil.Process]:
    """Live (not zombie) processes of process group ``pgid``."""
    alive = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of a process group this test started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _log(*procs: WorkerProcess) -> str:
    return "\n".join(p.log_path.read_text(errors="replace") for p in procs)


BEAT_LEASE_S = 3  # BATCHGEN_BEAT_LOCK_LEASE_S: how soon a standby beat takes over


def test_worker_child_sigkill_mid_run(sim, workers):
    """Workers run Celery's thread pool (any other is refused), so a worker's only
    child process is its embedded beat (``-B``, as ``batchgen dispatcher`` runs it;
    :func:`batchgen.worker.procs.beat_pids`). The beat holding the schedule is SIGKILLed mid-run:
    its dispatcher goes on consuming, a standby dispatcher's beat takes the schedule
    over once the lease runs out, and the run ends with the invariants intact."""
    from batchgen.worker.beat import schedule_holder
    from batchgen.worker.procs import beat_pids

    env = {**FAULT_ENV, "BATCHGEN_BEAT_LOCK_LEASE_S": str(BEAT_LEASE_S)}
    batch_id = submit_items("child", 100)
    first = workers([CONTROL_QUEUE], concurrency=2, env=env, name="dispatcher1", wait=False)
    second = workers([CONTROL_QUEUE], concurrency=2, env=env, name="dispatcher2", wait=False)
    llm = workers(_llm_queues(), beat=False, env=FAULT_ENV, name="worker", wait=False)
    _ready(first, second, llm)
    wait_until(lambda: succeeded_items(batch_id) >= 10, 60, "the run to start")
    holder = wait_until(lambda: schedule_holder(get_redis()), 30, "a beat holding the schedule")
    victim_pid = int(holder.split(":")[1])
    parent = next(w for w in (first, second) if victim_pid in beat_pids(w.process.pid))
    os.kill(victim_pid, signal.SIGKILL)
    done_at_kill = succeeded_items(batch_id)
    new_holder = wait_until(
        lambda: (h := schedule_holder(get_redis())) and h != holder and h,
        BEAT_LEASE_S + 30,
        "a standby beat to take the schedule over",
    )
    wait_batches([batch_id], timeout_s=120)

    assert done_at_kill < 100, "the run was over before the kill"
    assert victim_pid not in beat_pids(parent.process.pid)
    assert parent.process.poll() is None, "the beat's dispatcher died with it"
    assert int(new_holder.split(":")[1]) != victim_pid
    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": 100}


def test_worker_parent_sigkill_mid_call(sim, workers):
    """The worker's main process (thread pool: the calls run in it) is SIGKILLed alone,
    not its process group, with calls in flight; the other worker finishes the run."""
    sim_config(sim.base_url, latency_base_ms=SLOW_CALL_MS)
    batch_id = submit_items("parent", 100)
    survivor = workers(concurrency=SURVIVOR_THREADS, env=FAULT_ENV, name="survivor", wait=False)
    victim = workers(_llm_queues(), beat=False, env=FAULT_ENV, name="victim", wait=False)
    _ready(survivor, victim)
    wait_until(
        lambda: "succeeded prompt_tokens" in victim.log_tail(200), 60, "the victim to run items"
    )
    wait_mid_run(sim.base_url, batch_id, at_least=5)
    # More calls in flight than the survivor has threads: some are the victim's.
    wait_until(lambda: sim_in_flight(sim.base_url) > SURVIVOR_THREADS, 60, "victim calls")
    os.kill(victim.process.pid, signal.SIGKILL)
    victim.process.wait()
    wait_batches([batch_id], timeout_s=120)

    assert cut_calls(sim.base_url) >= 1, "no call was cut mid-flight"
    assert not _group_alive(victim.process.pid), "processes of the killed worker live on"
    report = check_invariants(
        sim.base_url,
        get_redis(),
        slot_grace_s=FAULT_RUNNING_LEASE_S,
        worker_killed=True,
    )
    assert report.statuses == {"succeeded": 100}


def test_sigterm_with_calls_in_flight(sim, workers):
    """SIGTERM (warm shutdown) while calls are in flight: the calls under way finish
    and are recorded, the messages not started go back to the broker, the worker
    exits, the other one finishes the run. Nothing is wasted, nothing runs twice."""
    sim_config(sim.base_url, latency_base_ms=SLOW_CALL_MS)
    batch_id = submit_items("sigterm", 100)
    survivor = workers(env=FAULT_ENV, name="survivor", wait=False)
    victim = workers(_llm_queues(), beat=False, env=FAULT_ENV, name="victim", wait=False)
    _ready(survivor, victim)
    wait_until(
        lambda: "succeeded prompt_tokens" in victim.log_tail(200), 60, "the victim to run items"
    )
    wait_mid_run(sim.base_url, batch_id, at_least=5)
    os.kill(victim.process.pid, signal.SIGTERM)
    assert victim.process.wait(60) == 0, victim.log_tail()
    wait_batches([batch_id], timeout_s=120)

    _, _, after_term = victim.log_tail(100_000).partition("Warm shutdown")
    assert "succeeded prompt_tokens" in after_term, "no call was in flight at the SIGTERM"
    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": 100}
    assert report.cut_calls == 0, "a warm shutdown cut calls"
    assert report.waste_rows == 0 and report.billed_calls == 100, report


TICK = "Scheduler: Sending due task"


def _ticks_after(log_path: Path, since: str) -> int:
    """Beat's "sending due task" lines logged at or after ``since`` (a log timestamp)."""
    lines = log_path.read_text(errors="replace").splitlines()
    return sum(1 for line in lines if TICK in line and line[:23] >= since)


def test_dispatcher_sigkill_and_restart(sim, workers):
    """The dispatcher (control queue with Celery beat embedded) is SIGKILLed mid-run,
    its main process only, as ``kill -9 <pid>`` does, and a new one is started. After
    the restart exactly one scheduler may send ticks: the old beat dies with its
    parent, or holds the schedule alone."""
    batch_id = submit_items("dispatcher", 100)
    old = workers([CONTROL_QUEUE], concurrency=2, env=FAULT_ENV, name="dispatcher", wait=False)
    try:
        _ready(old, workers(_llm_queues(), beat=False, env=FAULT_ENV, name="worker", wait=False))
        wait_until(lambda: succeeded_items(batch_id) >= 10, 60, "the run to start")
        group = old.process.pid  # start_new_session: the group id is the leader's pid
        beat = psutil.Process(group).children(recursive=True)
        os.kill(old.process.pid, signal.SIGKILL)
        old.process.wait()
        done_at_kill = succeeded_items(batch_id)
        new = workers([CONTROL_QUEUE], concurrency=2, env=FAULT_ENV, name="dispatcher2")
        # Celery logs "ready." just after the worker_ready signal that writes the ready file.
        since = wait_until(
            lambda: next(
                (line[:23] for line in new.log_tail(1_000_000).splitlines() if "ready." in line),
                None,
            ),
            30,
            "the new dispatcher's ready line",
        )
        wait_until(
            lambda: _ticks_after(old.log_path, since) + _ticks_after(new.log_path, since) >= 10,
            30,
            "ticks after the restart",
        )
        wait_batches([batch_id], timeout_s=120)

        assert beat, "the dispatcher had no embedded beat process"
        assert done_at_kill < 100, "the run was over before the kill"
        report = check_invariants(sim.base_url, get_redis())
        assert report.statuses == {"succeeded": 100}
        old_ticks, new_ticks = _ticks_after(old.log_path, since), _ticks_after(new.log_path, since)
        assert not (old_ticks and new_ticks), (
            f"two schedulers after the restart: the killed dispatcher's beat "
            f"{[p.pid for p in _group_alive(group)]} sent {old_ticks} ticks, the new one "
            f"{new_ticks}"
        )
    finally:
        _kill_group(old.process.pid)


def _publish(task_id: str, args: list[Any], **options: Any) -> None:
    from batchgen.tasks.celery_app import celery_app

    celery_app.send_task(
        "batchgen.generate",
        args=args,
        kwargs={"model": "sim-small"},
        queue=get_registry()["sim-small"].queue,
        task_id=task_id,
        **options,
    )


def test_forged_and_unknown_item_ids_published_to_the_queue(sim, workers):
    """Messages published straight to a model queue with ids the dispatcher never
    released: unknown, of a cancelled item, of an item already succeeded, not an
    integer, out of range. None reaches the provider, none disturbs the run."""
    sim_config(sim.base_url, latency_base_ms=200)
    batch_id = submit_items("forged", 60)
    make_tenant("other")
    cancelled = client.submit_batch([chat_line(f"c{i}") for i in range(3)], tenant="other")
    client.cancel_batch(cancelled["id"], tenant="other")
    worker = workers(env=FAULT_ENV, name="worker")
    wait_until(lambda: succeeded_items(batch_id) >= 5, 60, "the run to start")
    with db.session_scope() as s:
        done_id = s.scalar(select(Item.id).where(Item.status == "succeeded").limit(1))
        cancelled_id = s.scalar(select(Item.id).where(Item.batch_id == cancelled["id"]).limit(1))
    forged: dict[str, Any] = {
        "unknown": 10**9,
        "cancelled": cancelled_id,
        "succeeded": done_id,
        "text": "1 OR 1=1",
        "negative": -1,
        "out-of-range": 2**70,
        "object": {"id": done_id},
    }
    for name, value in forged.items():
        _publish(f"forged-{name}", [value])

    def handled() -> bool:
        log = worker.log_tail(100_000)
        return all(
            f"[forged-{n}] succeeded" in log or f"[forged-{n}] raised" in log for n in forged
        )

    wait_until(handled, 60, "every forged message to be handled")
    wait_batches([batch_id], timeout_s=120)

    assert worker.process.poll() is None
    log = worker.log_tail(100_000)
    for name in ("unknown", "cancelled", "succeeded", "negative"):
        assert re.search(rf"\[forged-{name}\] succeeded in \S+ 'skipped'", log), name
    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": 60, "cancelled": 3}
    assert report.calls_per_item.get(done_id) == 1
    assert cancelled_id not in report.calls_per_item


class _TouchOnUnpickle:
    """A pickle that creates a file when loaded: proof of deserialization."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_non_json_message_is_rejected_not_executed(sim, workers, tmp_path):
    """Task messages with a content type other than JSON (a pickle that would run code
    when loaded, and plain text) are refused by the worker: never deserialized, never
    executed, not redelivered; the run goes on."""
    sim_config(sim.base_url, latency_base_ms=200)
    batch_id = submit_items("content", 60)
    worker = workers(env=FAULT_ENV, name="worker")
    wait_until(lambda: succeeded_items(batch_id) >= 5, 60, "the run to start")
    with db.session_scope() as s:
        queued_id = s.scalar(select(Item.id).where(Item.status == "pending").limit(1))
    marker = tmp_path / "unpickled"
    _publish("pickled-1", [_TouchOnUnpickle(marker)], serializer="pickle")
    _publish("pickled-2", [queued_id], serializer="pickle")
    queue = get_registry()["sim-small"].queue
    from batchgen.tasks.celery_app import celery_app

    with Connection(celery_app.conf.broker_url) as conn:
        Producer(conn).publish(
            f"[[{queued_id}], {{}}, {{}}]",
            exchange="",
            routing_key=queue,
            content_type="text/plain",
            content_encoding="utf-8",
            headers={"lang": "py", "task": "batchgen.generate", "id": "plain-1"},
        )

    def refused() -> list[str]:
        return [
            line
            for line in worker.log_tail(100_000).splitlines()
            if "Received invalid task message: Refusing to deserialize untrusted" in line
        ]

    wait_until(lambda: len(refused()) >= 3, 60, "the worker to refuse the three messages")
    wait_batches([batch_id], timeout_s=120)

    assert not marker.exists(), "a pickle from the broker was loaded"
    assert sum("type pickle" in line for line in refused()) == 2
    assert sum("text/plain" in line for line in refused()) == 1
    log = worker.log_tail(100_000)
    for task_id in ("pickled-1", "pickled-2", "plain-1"):
        assert f"[{task_id}] received" not in log, f"{task_id} was accepted as a task"
    redis_client = get_redis()
    assert redis_client.llen(queue) == 0
    leftovers = [v for v in redis_client.hvals("unacked") if b"pickled-" in v or b"plain-" in v]
    assert not leftovers, "a refused message waits for redelivery"
    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": 60}
    assert report.billed_calls == 60


VISIBILITY_TIMEOUT_S = 2


def _restore_overdue(visibility_timeout_s: float) -> int:
    """What the Redis transport does in every consumer (at connect, then periodically):
    put messages unacknowledged for longer than the visibility timeout back in their
    queue. Returns how many it found overdue."""
    from batchgen.tasks.celery_app import celery_app

    options = {"visibility_timeout": visibility_timeout_s}
    with Connection(celery_app.conf.broker_url, transport_options=options) as conn:
        channel: Any = conn.default_channel
        overdue = int(
            channel.client.zcount(
                channel.unacked_index_key, "-inf", time.time() - visibility_timeout_s
            )
        )
        if overdue:
            channel.qos.restore_visible(num=1000)
        return overdue


def test_budget_waits_longer_than_the_visibility_timeout_run_once(sim, workers, tmp_path):
    """Budget waits go back to the broker as countdown retries; the worker holds such
    a message unacknowledged until it is due. With waits longer than the broker's
    visibility timeout, the Redis transport puts the same message back in its queue
    (every consumer does that sweep when it connects and then every ~100 s; the test
    runs it once the first message is overdue rather than waiting for it). Every
    duplicate must be absorbed: each item reaches the provider exactly once.

    Scaled: visibility timeout 2 s; a 4 s budget window (span 5 s with the guard)
    makes budget waits of up to 5 s, longer than the visibility timeout."""
    env = {
        **FAULT_ENV,
        "BATCHGEN_MODELS_FILE": str(models_file_with(tmp_path / "models.toml", tokens_per_min=600)),
        "BATCHGEN_BUDGET_WINDOW_S": "4",
        "BATCHGEN_VISIBILITY_TIMEOUT_S": str(VISIBILITY_TIMEOUT_S),
    }
    n = 24
    batch_id = submit_items("visibility", n)
    first = workers(env=env, name="first", wait=False)
    second = workers(_llm_queues(), beat=False, env=env, name="second", wait=False)
    _ready(first, second)
    restored = wait_until(
        lambda: _restore_overdue(VISIBILITY_TIMEOUT_S), 60, "a wait past the visibility timeout"
    )
    wait_batches([batch_id], timeout_s=180)

    log = _log(first, second)
    waits = [float(w.split("s", 1)[0]) for w in log.split("Retry in ")[1:]]
    assert max(waits) > VISIBILITY_TIMEOUT_S, f"no wait exceeded the visibility timeout: {waits}"
    # A message delivered again finds its items claimed: skipped (a pack's are counted).
    again = re.findall(r"succeeded in \S+ '[^']*\bskipped\b", log)
    assert restored >= 1 and again, "no message was delivered twice"
    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": n}
    assert report.billed_calls == n and report.waste_rows == 0, report


def test_api_process_killed_mid_call_a_worker_finishes_the_call(sim, workers, api_server):
    """A synchronous call runs in the API process; SIGKILL that process while the
    provider is answering: the caller gets no answer, but the call is not lost: its
    lease runs out, the sweep hands it back, a worker runs it to one result, and the
    call cut mid-flight is ledgered as waste."""
    import threading

    from batchgen.domain.lifecycle.status import CALL_RANK

    sim_config(sim.base_url, latency_base_ms=1500)
    # The caller's presence outlasts the call's running lease: the sweep that finds the
    # lease run out still sees a caller and hands the call on (once the presence has
    # lapsed, it would cancel it instead: tests/integration/test_faults_api.py).
    env = {**FAULT_ENV, "BATCHGEN_CALLER_LEASE_S": "300"}
    worker = workers(env=env, name="worker")
    base_url = api_server(env=env)
    key = make_tenant("caller")
    failures: list[BaseException] = []

    def call() -> None:
        try:
            http_client.post(
                f"{base_url}/v1/chat/completions",
                json={
                    "model": "sim-small",
                    "max_tokens": 20,
                    "messages": [{"role": "user", "content": "x"}],
                },
                headers={"Authorization": f"Bearer {key}", "X-Request-Timeout": "60"},
                timeout=60,
            )
        except BaseException as exc:  # the server dies under it
            failures.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    wait_until(lambda: sim_in_flight(sim.base_url) == 1, 30, "the call at the provider")
    api_pid = _api_pid(base_url)
    os.killpg(api_pid, signal.SIGKILL)
    caller.join(30)
    assert failures, "the caller got an answer from a killed server"

    def ended() -> str | None:
        with db.session_scope() as s:
            status = s.scalar(select(Item.status).where(Item.priority_rank == CALL_RANK))
        return status if status in ("succeeded", "failed", "expired", "cancelled") else None

    assert wait_until(ended, 60, "the call to end") == "succeeded"
    assert cut_calls(sim.base_url) >= 1, "no call was cut mid-flight"
    worker.stop()
    check_invariants(
        sim.base_url, get_redis(), slot_grace_s=FAULT_RUNNING_LEASE_S, worker_killed=True
    )


def _api_pid(base_url: str) -> int:
    """The leader of the process group of the processes listening on the API's port
    (gunicorn's master and its workers)."""
    port = int(base_url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            assert conn.pid is not None
            return os.getpgid(conn.pid)
    raise AssertionError(f"nothing listens on {port}")
