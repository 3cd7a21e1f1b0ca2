"""RabbitMQ as the Celery broker (``CELERY_BROKER_URL=amqp://…``): quorum queues,
publisher confirms, countdowns through native delayed delivery, and the broker faults
of the fault suite: a worker SIGKILLed mid-call, then, in one run, the broker's
connections closed and the broker unreachable for a while (a TCP proxy in front of
it, cut and restored).

Each test gets a RabbitMQ virtual host of its own (``batchgen_test_<pid>_<hex>``),
deleted afterwards, so nothing collides with other users of the shared server.
Redis (budgets, slots) and PostgreSQL are the session's. Outside CI the tests skip
when RabbitMQ is absent; in CI (``CI=true``) they fail instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from batchgen import python_api as client
from batchgen.config import get_settings
from batchgen.limits.backend import get_redis
from batchgen.monitoring.doctor import check_broker
from batchgen.monitoring.queues import lengths
from batchgen.registry import get_registry
from batchgen.worker.names import CONTROL_QUEUE
from batchgen.worker.procs import WorkerProcess
from tests.helpers import (
    chat_line,
    make_tenant,
    models_file_with,
    sim_config,
    sim_in_flight,
    status_summary,
    submit_items,
    succeeded_items,
    wait_batches,
    wait_mid_run,
)
from tests.invariants import check_invariants, reset_simulator, wait_until
from tests.tcp_proxy import TcpProxy
from tests.waiting import hold

pytestmark = pytest.mark.integration

RABBIT_HOST, RABBIT_PORT = "127.0.0.1", 5672
RABBIT_USER, RABBIT_PASSWORD = "guest", "guest"
JSON = ("--formatter", "json")
# Short leases and a fast sweep: items of a killed worker or a lost publish come back
# within seconds (a running item's lease: 2 x the call timeout + the margin).
FAST_RECOVERY = {
    "BATCHGEN_CALL_TIMEOUT_S": "2",
    "BATCHGEN_RUNNING_LEASE_MARGIN_S": "1",
    "BATCHGEN_QUEUED_LEASE_S": "3",
    "BATCHGEN_SWEEP_INTERVAL_S": "0.5",
}
RUNNING_LEASE_S = 5
# Celery's native delayed delivery: one queue per power of two seconds (1, 2, 4, 8 s).
DELAY_QUEUES = [f"celery_delayed_{level}" for level in range(4)]


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _unavailable() -> str | None:
    """Why the tests cannot use RabbitMQ here, or None."""
    if shutil.which("rabbitmqctl") is None:
        return "rabbitmqctl is not installed"
    try:
        socket.create_connection((RABBIT_HOST, RABBIT_PORT), timeout=2).close()
    except OSError as exc:
        return f"RabbitMQ does not answer on {RABBIT_HOST}:{RABBIT_PORT} ({exc})"
    return None


def _ctl(*args: str) -> str:
    done = subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Rabbit:
    vhost: str

    def url(self, port: int = RABBIT_PORT) -> str:
        return f"amqp://{RABBIT_USER}:{RABBIT_PASSWORD}@{RABBIT_HOST}:{port}/{self.vhost}"

    def env(self, port: int = RABBIT_PORT) -> dict[str, str]:
        """Worker environment: this vhost as the broker (Redis stays for budgets)."""
        return {"CELERY_BROKER_URL": self.url(port)}

    def queues(self) -> dict[str, dict[str, Any]]:
        """The vhost's queues by name: type and messages (ready + unacknowledged)."""
        out = _ctl("list_queues", "-p", self.vhost, "name", "type", "messages", *JSON)
        return {q["name"]: q for q in json.loads(out or "[]")}

    def close_connections(self) -> int:
        """Close every client connection of this vhost, as the broker does when it
        restarts or is put into maintenance; returns how many there were."""
        out = _ctl("list_connections", "-p", self.vhost, "name", *JSON)
        _ctl("close_all_connections", "--vhost", self.vhost, "batchgen test")
        return len(json.loads(out or "[]"))


@pytest.fixture
def rabbit() -> Iterator[Rabbit]:
    """A RabbitMQ virtual host of this test's own, deleted afterwards (name this fixture
    before ``workers``, so that the workers stop before their vhost goes)."""
    reason = _unavailable()
    if reason is not None:
        if _in_ci():
            pytest.fail(f"RabbitMQ is required in CI: {reason}")
        pytest.skip(reason)
    vhost = f"batchgen_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    _ctl("add_vhost", vhost)
    try:
        _ctl("set_permissions", "-p", vhost, RABBIT_USER, ".*", ".*", ".*")
        yield Rabbit(vhost)
    finally:
        _ctl("delete_vhost", vhost)


@pytest.fixture
def sim(simulator: Any, clean_db: dict[str, str]) -> Iterator[Any]:
    reset_simulator(simulator.base_url)
    yield simulator
    sim_config(simulator.base_url, latency_base_ms=50)


TASK_ID = r"Task batchgen\.generate\[([0-9a-f-]{36})\]"


def _received(worker: WorkerProcess) -> set[str]:
    """Task ids the worker took from the broker."""
    return set(re.findall(TASK_ID + " received", _log(worker)))


def _finished(worker: WorkerProcess) -> set[str]:
    """Task ids the worker ran to an end (an outcome, a retry or an error)."""
    return set(re.findall(TASK_ID + " (?:succeeded|retry|raised)", _log(worker)))


def _log(*workers: WorkerProcess) -> str:
    return "\n".join(w.log_tail(1_000_000) for w in workers)


def _broker_trouble(log: str) -> list[str]:
    """Lines that would mean a lost message or a broken topology."""
    needles = ("countdown must be", "NOT_FOUND", "PRECONDITION_FAILED", "Unrecoverable error")
    return [line for line in log.splitlines() if any(n in line for n in needles)]


def test_doctor_names_a_classic_queue_in_the_way(rabbit):
    """A classic queue named like one of ours (an earlier deployment) would stop every
    worker at its start: doctor says so and what to do; it creates nothing."""
    from kombu import Connection

    with Connection(rabbit.url()) as connection:
        channel = connection.channel()
        channel.queue_declare("llm.sim", durable=True)  # classic
        channel.close()
    settings = get_settings().model_copy(update={"celery_broker_url": rabbit.url()})
    doctor = check_broker(settings, get_registry())
    assert not doctor.ok and "llm.sim" in doctor.found, doctor
    assert doctor.fix and "delete" in doctor.fix
    assert set(rabbit.queues()) == {"llm.sim"}


PUBLISH = """
import sys
from batchgen.worker.publish import celery_app
print(celery_app.conf.broker_transport_options)
celery_app.send_task("batchgen.dispatch")
print("published")
celery_app.send_task("batchgen.dispatch", countdown=float(sys.argv[1]))
print("published with a countdown")
"""


def test_publisher_confirms_raise_what_the_broker_refuses(rabbit):
    """Publishes wait for the broker's confirm: a plain one is in its queue when
    send_task returns; one the broker refuses raises in the publisher instead of
    vanishing. On a vhost where no worker has started yet, the delay exchanges of
    native delayed delivery do not exist, so a countdown (0.3 s, under a second)
    is refused with NOT_FOUND, loudly."""
    done = _run_batchgen(["-c", PUBLISH, "0.3"], rabbit.env(), python=True, check=False)

    assert done.stdout.splitlines()[:2] == ["{'confirm_publish': True}", "published"], done
    assert done.returncode != 0 and "NOT_FOUND" in done.stderr, done.stderr[-2000:]
    assert "no exchange 'celery_delayed_" in done.stderr
    assert lengths(rabbit.url(), [CONTROL_QUEUE]) == {CONTROL_QUEUE: 1}


@pytest.mark.slow
def test_batch_runs_on_quorum_queues_with_countdown_retries(rabbit, sim, workers, tmp_path):
    """The whole pipeline on RabbitMQ: one batch for two model groups (two queues),
    one worker with the dispatcher, every item succeeded with one billed call.

    Budget and slot waits go back to the broker as retry(countdown): on quorum queues
    they wait in RabbitMQ's delay queues (native delayed delivery), not
    unacknowledged in a worker; waits under a second (a slot wait asks about 0.5 s)
    are rounded up to one second instead of being refused. The queues are quorum
    queues, and status's queue lengths and doctor's broker check read RabbitMQ.

    Scaled: sim-small gets 300 tokens per 2 s window (about 4 calls) and 2 slots for
    8 worker threads; calls take 400 ms, longer than a slot wait (0.1 s)."""
    names = [CONTROL_QUEUE, *get_registry().queues]
    assert lengths(rabbit.url(), names) == dict.fromkeys(names, 0)  # none declared yet
    models = models_file_with(tmp_path / "models.toml", tokens_per_min=300, max_concurrency=2)
    env = {
        **rabbit.env(),
        "BATCHGEN_MODELS_FILE": str(models),
        "BATCHGEN_BUDGET_WINDOW_S": "2",
        "BATCHGEN_SLOT_WAIT_S": "0.1",
    }
    sim_config(sim.base_url, latency_base_ms=400)
    make_tenant("rabbit")
    lines = [chat_line(f"s{i}") for i in range(12)]
    lines += [chat_line(f"l{i}", model="sim-large") for i in range(12)]
    batch_id = client.submit_batch(lines, tenant="rabbit")["id"]
    worker = workers(env=env, name="worker")
    delayed = _Peak(lambda: sum(n or 0 for n in lengths(rabbit.url(), DELAY_QUEUES).values()))
    try:
        wait_batches([batch_id], timeout_s=60)
    finally:
        delayed.stop()

    log = _log(worker)
    waits = [float(w.split("s", 1)[0]) for w in log.split("Retry in ")[1:]]
    assert waits and min(waits) < 1 < max(waits), f"want waits under and over 1 s: {waits}"
    assert delayed.peak > 0, "no countdown waited in the delay queues"
    assert not _broker_trouble(log)
    queues = rabbit.queues()
    assert {name: queues[name]["type"] for name in names} == dict.fromkeys(names, "quorum")
    assert {queues[q]["type"] for q in DELAY_QUEUES} == {"quorum"}
    assert lengths(rabbit.url(), names) == dict.fromkeys(names, 0)
    settings = get_settings().model_copy(update={"celery_broker_url": rabbit.url()})
    doctor = check_broker(settings, get_registry())
    assert doctor.ok and "quorum" in doctor.found, doctor
    status = json.loads(_run_batchgen(["status", "--json"], rabbit.env()).stdout)
    rows = {row["queue"]: row for row in status["queues"]}
    assert rows["llm.sim"]["messages"] == 0 and rows["llm.sim"]["workers"] == ["worker@" + HOST]
    worker.kill()  # the run is checked; no warm shutdown to wait for
    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": 24}
    assert report.billed_calls == 24 and report.waste_rows == 0, report


@pytest.mark.slow
def test_sigkill_worker_mid_call_redelivers_and_loses_nothing(rabbit, sim, workers):
    """kill -9 of a worker with calls in flight: RabbitMQ puts its unacknowledged
    messages back at once (the consumer's connection closed; no visibility timeout to
    wait for) and the other worker receives them; the items cut mid-call come back
    through the sweep; every item ends succeeded with one result."""
    sim_config(sim.base_url, latency_base_ms=700)
    batch_id = submit_items("rkill", 40)
    env = {**rabbit.env(), **FAST_RECOVERY}
    victim = workers(get_registry().queues, beat=False, env=env, name="victim", wait=False)
    survivor = workers(env=env, name="survivor", wait=False)
    victim.wait_ready()  # both start at once
    survivor.wait_ready()
    wait_until(lambda: "succeeded in" in _log(victim), 60, "the victim to finish a call")
    in_hand = wait_until(
        lambda: sim_in_flight(sim.base_url) > 0 and _received(victim) - _finished(victim),
        60,
        "the victim to hold messages while calls are in flight",
        0.02,
    )
    victim.kill()
    wait_batches([batch_id], timeout_s=180)

    survivor.kill()  # the run is over; no warm shutdown to wait for
    redelivered = in_hand & _received(survivor)
    assert in_hand, "the victim held no message when it was killed"
    assert redelivered, "no message of the killed worker was delivered again"
    assert not _broker_trouble(_log(victim, survivor))
    report = check_invariants(
        sim.base_url, get_redis(), slot_grace_s=RUNNING_LEASE_S, worker_killed=True
    )
    assert report.statuses == {"succeeded": 40}
    # Each call the kill cut came back as another attempt of its item. (Which of the
    # victim's messages were mid-call rather than waiting in its prefetch, the
    # broker cannot tell; on a quiet machine the kill cuts some.)
    assert report.retried_items >= report.cut_calls


@pytest.mark.slow
def test_broker_connections_closed_then_unreachable_mid_run(rabbit, sim, workers):
    """Two broker faults in one run, with calls in flight each time:

    1. RabbitMQ closes every connection of the vhost (what a broker restart or a node
       put into maintenance does to its clients): the worker reconnects at once.
    2. The broker is unreachable for 4 s (a TCP proxy in front of it closes every
       connection and refuses new ones, then listens again): the worker and its
       dispatcher retry until it is back; publishes that failed meanwhile are
       recovered by the sweep.

    The worker survives both (no restart), messages it had not acknowledged come back
    and are skipped or run, and every item ends succeeded with one billed call.

    Each fault meets a run under way whatever the machine's speed: the second batch
    is submitted once the worker has reconnected (the first may have ended by then),
    and the cut waits until that batch's calls are in flight."""
    sim_config(sim.base_url, latency_base_ms=300)
    first = submit_items("rfault", 120)
    with TcpProxy(RABBIT_HOST, RABBIT_PORT) as proxy:
        worker = workers(env={**rabbit.env(proxy.port), **FAST_RECOVERY}, name="worker")
        wait_mid_run(sim.base_url, first)
        closed = rabbit.close_connections()
        wait_until(lambda: _log(worker).count("Connected to amqp") >= 2, 60, "a reconnect")
        second = submit_items("rfault2", 120)
        wait_mid_run(sim.base_url, second)  # the reconnected worker runs it
        cut = proxy.cut()
        done_at_cut = succeeded_items(second)
        hold(4, "the outage's length: the worker and dispatcher retry meanwhile")
        accepted = proxy.accepted
        proxy.restore()
        wait_batches([first, second], timeout_s=180)
        reconnected = proxy.accepted - accepted
        alive = worker.process.poll() is None
        worker.kill()  # the run is over; no warm shutdown to wait for

    assert closed > 0 and cut > 0 and done_at_cut < 120, (closed, cut, done_at_cut)
    assert reconnected > 0, "nothing reconnected through the proxy"
    assert _log(worker).count("Connection to broker lost") >= 2
    assert alive, "the worker died with its broker"
    report = check_invariants(sim.base_url, get_redis(), slot_grace_s=RUNNING_LEASE_S)
    assert report.statuses == {"succeeded": 240}, status_summary()


# -- helpers ---------------------------------------------------------------------

HOST = socket.gethostname()


def _run_batchgen(
    argv: list[str], env: dict[str, str], *, python: bool = False, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``batchgen <argv>`` (or ``python <argv>``) in a process of its own with ``env``."""
    import sys

    command = [sys.executable, *argv] if python else [sys.executable, "-m", "batchgen.cli", *argv]
    done = subprocess.run(
        command, env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    if check and done.returncode != 0:
        raise AssertionError(f"{argv} failed: {done.stderr[-2000:]}")
    return done


class _Peak:
    """The largest value ``read`` returned, sampled in a thread until :meth:`stop`."""

    def __init__(self, read: Callable[[], int], every_s: float = 0.1) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(read, every_s), daemon=True)
        self._thread.start()

    def _run(self, read: Callable[[], int], every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.peak = max(self.peak, read())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
