"""Multi-host, shown: three hosts as Linux network namespaces, two worker processes each.

Topology (root namespace and three ``ip netns`` hosts on one bridge, names and subnet
unique per run)::

    root namespace            bridge 10.77.N.1   Redis (budgets, slots, broker), and a
                                                 TCP forwarder to the test's PostgreSQL
                              bridge 10.77.N.10  the provider simulator
    netns host1 .. host3      10.77.N.11 .. 13   two ``celery worker`` processes each

A namespace cannot reach the root namespace's 127.0.0.1, so every worker reaches
Redis, PostgreSQL and the provider over the bridge, as separate machines would
(the test proves it from Redis's own ``CLIENT LIST``).

The simulator enforces nothing here: it *measures*. Its limiter has no limit but the
model's window, so it records every call it received and ``/_sim/stats`` reports the
largest charge (prompt + ``max_tokens``, reserve mode) and request count in any
window of ``WINDOW_S`` seconds, on the simulator's own clock. batchgen's registry
says the provider allows ``TOKENS_PER_WINDOW`` and ``REQUESTS_PER_WINDOW``.

Clocks (read from the code, see the skew test): budgets and slot leases live on
Redis's clock (``TIME`` in ``app/limits/lua/lib/clock.lua``), item leases and
deadlines on PostgreSQL's (``now()`` at the claim, carried forward by the worker's
monotonic clock: ``app/domain/lifecycle/deadlines.py``). The one wall clock left is Celery's:
a budget wait is ``self.retry(countdown=...)`` (``tasks/generate.py``), which Celery
turns into an absolute ETA on the *sender's* clock, and beat ticks carry an absolute
``expires``. The skew test shows what that costs (a delay, bounded by the queued
lease, never a lost or doubled item).

Root and ``ip netns`` are needed: outside CI the module is skipped without them; in
CI (``CI=true``) it fails instead. The skew test needs libfaketime (installed with
apt-get when missing, as root).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from batchgen import python_api as client
from batchgen.config import get_settings
from batchgen.embedded import free_port
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import get_redis
from batchgen.registry import load_registry
from batchgen.simulator import SimulatorConfig, SimulatorThread
from batchgen.worker import procs
from batchgen.worker.procs import WORKER_POOL, WorkerProcess
from tests import forkserver, http_client
from tests.helpers import (
    FAULT_ENV,
    FAULT_RUNNING_LEASE_S,
    chat_line,
    make_tenant,
    succeeded_items,
    wait_batches,
)
from tests.invariants import check_invariants, cut_calls, reset_simulator, wait_until
from tests.tcp_proxy import TcpProxy, proxy_for_postgres
from tests.waiting import hold

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# The busiest window's share of the token limit that hosts at full tilt must reach
# (one host alone stays under 0.6 of it).
NEAR_THE_LIMIT = 0.7
IP = shutil.which("ip") or "/usr/sbin/ip"
HOSTS = 3
WORKERS_PER_HOST = 2
THREADS = 2  # per worker process: one host runs 4 calls at a time
CALL_MS = 400  # the simulator's latency: one host can do at most 10 calls a second

WINDOW_S = 3.0
# The budget's guard covers a call's way from the gate to the simulator's clock: up to
# a second on a loaded 2-core machine (with 0.5 s, some CI runs went 1-2.5 % over).
GUARD_S = 1.0
# About 53 tokens a call (prompt + max_tokens): the tokens bind, at ~21 calls a
# second (the window's limit over window + guard), far more than one host can do
# (≤ 10) and less than three (≤ 30).
TOKENS_PER_WINDOW = 4500
REQUESTS_PER_WINDOW = 110
STRETCH_S = 2 * WINDOW_S  # how long each measured stretch of the scaling test lasts
# Two hosts' worth of the limits, for the skew test's two hosts (its own account).
SKEW_TOKENS_PER_WINDOW = 2500
SKEW_REQUESTS_PER_WINDOW = 70
MAX_TOKENS = 40
TOLERANCE = 1.01
SKEW = "+5m"
SKEW_S = 300.0
MODEL = "multihost"
QUEUES = [f"llm.{MODEL}", "batchgen.control"]
SKEW_MODEL = "multihost-skew"  # the same queue (group), a budget of its own
LIMITS = {
    MODEL: (TOKENS_PER_WINDOW, REQUESTS_PER_WINDOW),
    SKEW_MODEL: (SKEW_TOKENS_PER_WINDOW, SKEW_REQUESTS_PER_WINDOW),
}
BEAT_HOST = 3  # its first worker runs the beat (dispatch and sweep ticks)

MODELS_TOML = """
[models."{model}"]
provider = "openai"
base_url = "{base_url}/v1"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "multihost"
budget_key = "{model}-account"
context_window = 16384
max_output_tokens = 400
tokens_per_min = {tpm}
requests_per_min = {rpm}
max_concurrency = 24
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0
encoding = "cl100k_base"
charge_policy = "reserve"
# The simulator measures windows and sends no rate-limit headers to learn a shape from:
# the registry says the limits are per window.
limit_shape = "window"
"""

# libfaketime 0.9.10 with FAKETIME_DONT_FAKE_MONOTONIC=1 breaks Python 3.11's
# time.sleep (clock_nanosleep with TIMER_ABSTIME on the monotonic clock gets a bad
# deadline: EINVAL, wolfcw/libfaketime#426), and without it every timed wait on a
# lock hangs (glibc's sem_clockwait reaches the kernel with a faked monotonic time).
# So the skewed host fakes the wall clock only (as a real skewed host: NTP moves the
# wall clock, not the monotonic one) and sleeps by a timed wait, which works.
SLEEP_FIX = """
import threading
import time


def _sleep(seconds):
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    threading.Event().wait(seconds)


time.sleep = _sleep
"""


def _fail_or_skip(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"multi-host test cannot run in CI: {reason}")
    pytest.skip(reason)


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


# --- the network ----------------------------------------------------------------------


@dataclass
class Network:
    """A bridge in the root namespace and one network namespace per host, each joined to
    the bridge by a veth pair. Names carry the pid, the subnet is one not in use."""

    tag: str
    subnet: str  # "10.77.N"
    namespaces: list[str] = field(default_factory=list)
    bridge_up: bool = False

    @property
    def bridge(self) -> str:
        return f"bgmh{self.tag}"

    @property
    def root_ip(self) -> str:
        return f"{self.subnet}.1"

    @property
    def simulator_ip(self) -> str:
        return f"{self.subnet}.10"

    def host_ip(self, host: int) -> str:
        return f"{self.subnet}.{10 + host}"

    def namespace(self, host: int) -> str:
        return f"bgmh{self.tag}-h{host}"

    def create(self) -> None:
        _run(IP, "link", "add", self.bridge, "type", "bridge")
        self.bridge_up = True
        _run(IP, "addr", "add", f"{self.root_ip}/24", "dev", self.bridge)
        _run(IP, "addr", "add", f"{self.simulator_ip}/24", "dev", self.bridge)
        _run(IP, "link", "set", self.bridge, "up")
        for host in range(1, HOSTS + 1):
            ns = self.namespace(host)
            outer, inner = f"bgmh{self.tag}v{host}", f"bgmh{self.tag}p{host}"
            _run(IP, "netns", "add", ns)
            self.namespaces.append(ns)
            _run(IP, "link", "add", outer, "type", "veth", "peer", "name", inner)
            _run(IP, "link", "set", inner, "netns", ns)
            _run(IP, "link", "set", outer, "master", self.bridge, "up")
            _run(IP, "-n", ns, "link", "set", inner, "name", "eth0")
            _run(IP, "-n", ns, "addr", "add", f"{self.host_ip(host)}/24", "dev", "eth0")
            _run(IP, "-n", ns, "link", "set", "eth0", "up")
            _run(IP, "-n", ns, "link", "set", "lo", "up")

    def destroy(self) -> None:
        """Kill what still runs in our namespaces (only processes this test started run
        there), delete them (their veth pairs go with them) and the bridge."""
        for ns in self.namespaces:
            with contextlib.suppress(Exception):
                for pid in _run(IP, "netns", "pids", ns).split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(Exception):
                _run(IP, "netns", "del", ns)
        self.namespaces.clear()
        if self.bridge_up:
            with contextlib.suppress(Exception):
                _run(IP, "link", "del", self.bridge)
            self.bridge_up = False


def _free_subnet() -> str:
    used = _run(IP, "-4", "-o", "addr", "show")
    start = os.getpid() % 200
    for offset in range(200):
        candidate = f"10.77.{20 + (start + offset) % 200}"
        if f" {candidate}." not in used:
            return candidate
    raise RuntimeError("no free 10.77.x.0/24 subnet")


def _check_privileges() -> None:
    if sys.platform != "linux":
        _fail_or_skip("network namespaces need Linux")
    if os.geteuid() != 0:
        _fail_or_skip("network namespaces need root")
    if not Path(IP).exists():
        _fail_or_skip(f"no ip command ({IP})")
    try:
        _run(IP, "netns", "list")
    except (OSError, RuntimeError) as exc:
        _fail_or_skip(f"ip netns is not available: {exc}")


# --- the cluster: network, Redis, PostgreSQL forwarder, simulator -----------------------


@dataclass
class Cluster:
    """The servers and the hosts' workers, kept running across the module's tests (a
    worker takes seconds to start). Host 3's first worker runs the beat."""

    net: Network
    redis_url: str
    database_url: str  # through the forwarder, for the workers
    proxy: TcpProxy
    sim: SimulatorThread
    env: dict[str, str]  # the workers' environment (on top of a cleaned os.environ)
    log_dir: Path
    hosts: dict[int, list[WorkerProcess]] = field(default_factory=dict)
    skewed: set[int] = field(default_factory=set)
    idle: set[int] = field(default_factory=set)  # hosts not consuming the model's queue

    def _start_worker(self, host: int, index: int, *, skewed: bool) -> WorkerProcess:
        """``celery worker`` inside host ``host``'s namespace (its own process group):
        forked by the suite's fork server into the namespace, or (a skewed clock, whose
        libfaketime loads at exec) run by ``ip netns exec``, which execs it, so the pid
        is the worker's either way."""
        name = f"h{host}w{index}"
        log_path = self.log_dir / f"{name}.log"
        ready_path = self.log_dir / f"{name}.ready"
        ready_path.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "celery"]
        argv += ["-A", "batchgen.tasks", "worker", "-Q", ",".join(QUEUES), "-P", WORKER_POOL]
        argv += ["-c", str(THREADS), "-n", f"{name}@%h", "--without-mingle", "--without-gossip"]
        argv += ["--loglevel", "INFO"]
        if host == BEAT_HOST and index == 1:
            argv += ["-B", "-s", str(self.log_dir / f"{name}-beat-schedule")]
        env = {**_clean_environ(), **self.env, "BATCHGEN_READY_FILE": str(ready_path)}
        namespace = self.net.namespace(host)
        process: procs.Process
        if skewed:  # libfaketime is preloaded at exec
            env.update(skew_env(self.log_dir))
        elif forkserver.enabled():  # the suite's fork server, inside the host's namespace
            process = forkserver.spawn(argv, env, log_path, netns=namespace)
            return WorkerProcess(name, process, log_path, ready_path)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [IP, "netns", "exec", namespace, *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return WorkerProcess(name, process, log_path, ready_path)

    def ensure(self, hosts: list[int], *, skewed: int | None = None) -> None:
        """Exactly ``hosts`` run their two workers (host ``skewed`` with its clock
        SKEW off, the others on time), all consuming the model's queue. Workers that
        died or have the wrong clock are replaced; all missing ones start together."""
        for host in list(self.hosts):
            alive = all(w.process.poll() is None for w in self.hosts[host])
            if host not in hosts or not alive or ((host == skewed) != (host in self.skewed)):
                self.stop([host])
        starting = [
            self._start_worker(h, i, skewed=h == skewed)
            for h in hosts
            if h not in self.hosts
            for i in range(1, WORKERS_PER_HOST + 1)
        ]
        for w in starting:
            w.wait_ready(120)
            self.hosts.setdefault(int(w.name[1]), []).append(w)
        if skewed is not None:
            self.skewed.add(skewed)
        self.consume([h for h in hosts if h in self.idle], True)

    def consume(self, hosts: list[int], on: bool) -> None:
        """Start or stop the model's queue consumers of ``hosts`` (Celery remote
        control; they keep consuming the control queue)."""
        if not hosts:
            return
        from celery import Celery

        names = [f"{w.name}@{socket.gethostname()}" for h in hosts for w in self.hosts[h]]
        control = Celery("multihost-control", broker=self.redis_url, set_as_current=False)
        try:
            if on:
                replies = control.control.add_consumer(
                    QUEUES[0], destination=names, reply=True, timeout=10
                )
            else:
                replies = control.control.cancel_consumer(
                    QUEUES[0], destination=names, reply=True, timeout=10
                )
        finally:
            control.close()
        answered = {name for reply in replies for name in reply}
        assert answered == set(names), f"consumers of {names}: replies {replies}"
        self.idle = self.idle - set(hosts) if on else self.idle | set(hosts)

    def stop(self, hosts: list[int] | None = None) -> None:
        """Warm shutdown of the hosts' workers at once, then SIGKILL what is left."""
        hosts = list(self.hosts) if hosts is None else hosts
        workers = [w for h in hosts for w in self.hosts.pop(h, [])]
        for w in workers:
            if w.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(w.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for w in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.process.wait(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.process.pid, signal.SIGKILL)
            w.process.wait()
        self.skewed -= set(hosts)
        self.idle -= set(hosts)

    def kill(self, host: int) -> None:
        """SIGKILL both worker processes of ``host`` at once (no warm shutdown, no acks)."""
        for w in self.hosts[host]:
            os.killpg(w.process.pid, signal.SIGKILL)
        for w in self.hosts.pop(host):
            w.process.wait()
        self.skewed.discard(host)
        self.idle.discard(host)

    def workers(self, host: int) -> list[WorkerProcess]:
        return self.hosts[host]

    def redis(self) -> redis.Redis:
        return get_redis(self.redis_url)

    def client_hosts(self) -> set[str]:
        """The addresses Redis sees its clients connect from."""
        return {c["addr"].rsplit(":", 1)[0] for c in self.redis().client_list()}


def _clean_environ() -> dict[str, str]:
    """This process's environment without the servers it uses (the workers get theirs)."""
    drop = {
        "DATABASE_URL",
        "REDIS_URL",
        "CELERY_BROKER_URL",
        "BATCHGEN_DATABASE_URL",
        "BATCHGEN_DATABASE_DIRECT_URL",
        "BATCHGEN_REDIS_URL",
        "BATCHGEN_CELERY_BROKER_URL",
        "BATCHGEN_SIMULATOR_URL",
    }
    return {k: v for k, v in os.environ.items() if k not in drop}


def _redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    from batchgen.embedded import redis_server_binary

    return redis_server_binary()


def _start_redis(host: str, folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server of the test's own, listening on ``host`` only; and its URL."""
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    # Bound to the bridge only (not reachable from anywhere else), so no protected mode.
    argv = [_redis_binary(), "--port", str(port), "--bind", host, "--protected-mode", "no"]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(folder)]
    argv += ["--logfile", str(folder / "redis.log")]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = redis.Redis(host=host, port=port, socket_connect_timeout=0.2)

    def answers() -> bool:
        try:
            return bool(probe.ping())
        except redis.RedisError:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server on {host}:{port} exited") from None
            return False

    try:
        wait_until(answers, 10, f"redis-server on {host}:{port} to start", poll_s=0.05)
    except (AssertionError, RuntimeError):
        process.kill()
        process.wait()
        raise
    probe.close()
    return process, f"redis://{host}:{port}/0"


@pytest.fixture(scope="module")
def cluster(
    services: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    _check_privileges()
    tmp = tmp_path_factory.mktemp("multihost")
    net = Network(tag=str(os.getpid() % 100_000), subnet=_free_subnet())
    with contextlib.ExitStack() as stack, pytest.MonkeyPatch.context() as mp:
        stack.callback(net.destroy)  # last: after the workers, servers and the proxy
        try:
            net.create()
        except RuntimeError as exc:
            _fail_or_skip(f"cannot create network namespaces: {exc}")
        redis_process, redis_url = _start_redis(net.root_ip, tmp / "redis")

        def stop_redis() -> None:
            redis_process.terminate()
            try:
                redis_process.wait(5)
            except subprocess.TimeoutExpired:
                redis_process.kill()
                redis_process.wait()

        stack.callback(stop_redis)
        proxy, database_url = proxy_for_postgres(services["DATABASE_URL"], net.root_ip)
        stack.callback(proxy.stop)
        config = SimulatorConfig(window_s=WINDOW_S, latency_base_ms=CALL_MS, seed=11)
        sim = stack.enter_context(SimulatorThread(config, host=net.simulator_ip))
        models = tmp / "models.toml"
        models.write_text(
            "".join(
                MODELS_TOML.format(model=name, base_url=sim.base_url, tpm=tpm, rpm=rpm)
                for name, (tpm, rpm) in LIMITS.items()
            )
        )
        settings = {
            **FAULT_ENV,  # first: the window below is the simulator's, not the faults' own
            "BATCHGEN_MODELS_FILE": str(models),
            "BATCHGEN_BUDGET_WINDOW_S": str(WINDOW_S),
            "BATCHGEN_BUDGET_GUARD_S": str(GUARD_S),
            "BATCHGEN_MAX_COUNTDOWN_S": "10",
            "BATCHGEN_DISPATCH_INTERVAL_S": "0.3",
            # One item a message: a host's threads then bound its calls in flight
            # (THREADS x WORKERS_PER_HOST), as the scaling test's one host needs. Packs
            # run as groups overlap their calls past the threads (up to the model's 24
            # slots: 77 calls in a stretch where 4 at a time allow 60, in a CI run);
            # their kills and outages have tests of their own (test_pack_calls.py).
            "BATCHGEN_PACK_MAX_ITEMS": "1",
            # At the limits, a retry that came due may wait in its worker's thread pool
            # behind others (a pack's task held a thread 13 s on a loaded CI machine):
            # 20 s could run out there. A retry held back by a skewed clock would wait
            # five minutes, far past 40 s (the skew test).
            "BATCHGEN_QUEUED_LEASE_S": "40",
        }
        env = {**settings, "DATABASE_URL": database_url, "REDIS_URL": redis_url}
        # This process talks to PostgreSQL directly and to the cluster's Redis.
        for key, value in {**settings, "REDIS_URL": redis_url}.items():
            mp.setenv(key, value)
        mp.delenv("BATCHGEN_REDIS_URL", raising=False)
        get_settings.cache_clear()
        load_registry.cache_clear()
        stack.callback(load_registry.cache_clear)
        stack.callback(get_settings.cache_clear)
        c = Cluster(net, redis_url, database_url, proxy, sim, env, tmp / "logs")
        c.log_dir.mkdir()
        stack.callback(c.stop)
        yield c


@pytest.fixture
def run(cluster: Cluster, clean_db: dict[str, str]) -> Iterator[Cluster]:
    """A clean run: empty tables, no budget, slot or counter left in the cluster's Redis
    (the broker's keys stay: the workers run on), the simulator's log emptied. Item ids
    start where no earlier test's went: a message an earlier test left behind (held by
    a worker for its ETA, or unacked by a killed one) can never name an item of this one."""
    from sqlalchemy import text

    from batchgen.store.db import get_engine

    global _RUNS
    _RUNS += 1
    with get_engine().begin() as conn:
        conn.execute(
            text("SELECT setval(pg_get_serial_sequence('items', 'id'), :n)"), {"n": _RUNS * 100_000}
        )
    r = cluster.redis()
    for key in r.scan_iter(match="bg:*", count=1000):
        r.delete(key)
    # Both stores are empty, as at a first start: the gate's state is known good (the
    # workers that run on would otherwise take this run's first calls as evidence of
    # lost state, and rebuild the budget as spent).
    r.set(keys.gate_state(), "clean run")
    reset_simulator(cluster.sim.base_url)
    yield cluster
    wait_until(lambda: all(r.llen(q) == 0 for q in QUEUES), 30, "the queues to empty")


_RUNS = 0


# --- what the simulator measured --------------------------------------------------------


def sim_stats(cluster: Cluster) -> dict[str, Any]:
    return dict(http_client.get(f"{cluster.sim.base_url}/_sim/stats", timeout=10).json())


def sim_calls(cluster: Cluster) -> list[dict[str, Any]]:
    log = http_client.get(f"{cluster.sim.base_url}/_sim/log", timeout=30).json()
    return [e for e in log if e["admitted"]]


def fresh_call_from(cluster: Cluster, host: int, within_s: float = CALL_MS / 4000) -> bool:
    """The simulator holds an admitted call from ``host``'s address, begun less than
    ``within_s`` ago (so still far from its answer)."""
    recent = http_client.get(f"{cluster.sim.base_url}/_sim/log?limit=60", timeout=10).json()
    now = time.time()
    return any(
        e["peer"] == cluster.net.host_ip(host)
        and e["admitted"]
        and e["end_ts"] is None
        and now - e["start_ts"] < within_s
        for e in recent
    )


def calls_between(calls: list[dict[str, Any]], start: float, end: float) -> int:
    return sum(1 for e in calls if start <= e["start_ts"] < end)


def assert_limits_held(cluster: Cluster, model: str = MODEL) -> tuple[float, float]:
    """The largest charge and request count the simulator received in any window (a
    test calls one model only), as fractions of the model's limits; both at most
    TOLERANCE."""
    stats = sim_stats(cluster)
    tpm, rpm = LIMITS[model]
    tokens = stats["max_tokens_in_any_window"] / tpm
    requests = stats["max_requests_in_any_window"] / rpm
    assert stats["window_s"] == WINDOW_S
    assert tokens <= TOLERANCE, stats
    assert requests <= TOLERANCE, stats
    return tokens, requests


def items(prefix: str, n: int, model: str = MODEL) -> list[dict[str, Any]]:
    return [
        chat_line(
            f"{prefix}-{i}",
            model=model,
            text=f"Describe product {prefix} {i}.",
            max_tokens=MAX_TOKENS,
        )
        for i in range(n)
    ]


def submit(tenant: str, n: int, model: str = MODEL, **options: Any) -> str:
    make_tenant(tenant)
    return str(client.submit_batch(items(tenant, n, model), tenant=tenant, **options)["id"])


def assert_over_the_bridge(cluster: Cluster, hosts: list[int]) -> None:
    """Redis's clients include every host's own address: the workers reached it over
    the bridge, from their namespaces."""
    seen = cluster.client_hosts()
    missing = {cluster.net.host_ip(h) for h in hosts} - seen
    assert not missing, f"no Redis client from {sorted(missing)}; clients from {sorted(seen)}"
    assert cluster.proxy.accepted > 0, "no worker reached PostgreSQL through the forwarder"


def log_marks(workers: list[WorkerProcess]) -> list[int]:
    """Where each worker's log ends now (a host's logs go on across the tests)."""
    return [w.log_path.stat().st_size for w in workers]


def logs_since(workers: list[WorkerProcess], marks: list[int]) -> str:
    parts = []
    for w, mark in zip(workers, marks, strict=True):
        with open(w.log_path, "rb") as f:
            f.seek(mark)
            parts.append(f.read().decode(errors="replace"))
    return "\n".join(parts)


def swept_back(text: str) -> int:
    """Items the sweep put back to pending (their queued or running lease ran out)."""
    return sum(int(m) for m in re.findall(r"sweep expired=\d+ requeued=(\d+)", text))


# --- the tests --------------------------------------------------------------------------


def test_throughput_grows_with_hosts_until_the_limit_which_holds_globally(run: Cluster) -> None:
    """One host (4 calls at a time, 400 ms each: at most 10 calls a second) cannot reach
    the provider's limit (~21 calls a second); three hosts reach it and go no further.
    The same stretch of time sees clearly more calls with 3 hosts than with 1, and in
    no window did the simulator receive more than the limits."""
    run.ensure([1, 2, 3])
    run.consume([2, 3], False)
    n = 260
    batch_id = submit("scale", n)
    wait_until(lambda: len(sim_calls(run)) >= 5, 30, "the first host to call")
    t1 = time.time() + 1.0  # past the start
    hold(t1 + STRETCH_S - time.time(), "one host's stretch")
    run.consume([2, 3], True)
    t3 = time.time() + 1.0
    hold(t3 + STRETCH_S - time.time(), "three hosts' stretch")
    assert_over_the_bridge(run, [1, 2, 3])
    wait_batches([batch_id], timeout_s=60)

    report = check_invariants(run.sim.base_url, run.redis())
    calls = sim_calls(run)
    one, three = calls_between(calls, t1, t1 + STRETCH_S), calls_between(calls, t3, t3 + STRETCH_S)
    tokens, requests = assert_limits_held(run)
    per_call = sum(e["charged_tokens"] for e in calls) / len(calls)
    limit_calls = TOKENS_PER_WINDOW / per_call / WINDOW_S * STRETCH_S
    print(
        f"\nmultihost scaling: 1 host {one} calls, 3 hosts {three} calls in {STRETCH_S:.0f} s "
        f"(ratio {three / max(1, one):.2f}; the limit allows at most {limit_calls:.0f}); "
        f"max window: tokens {tokens:.3f}x, requests {requests:.3f}x of the limit"
    )
    assert report.statuses == {"succeeded": n}
    assert one <= 0.6 * limit_calls, "one host came near the limit: the test shows nothing"
    assert three >= 1.5 * one
    # Near the limit, not at it: the suite's other tests share these cores (xdist).
    assert tokens >= NEAR_THE_LIMIT, "three hosts did not run near the limit"


def test_a_killed_host_loses_nothing(run: Cluster) -> None:
    """Both worker processes of host 2 are SIGKILLed mid-run with calls in flight; the
    other hosts finish the run: every item succeeded once, one result each, the ledger
    matches the simulator's own log, and the limits held throughout."""
    run.ensure([1, 2, 3])
    n = 200
    victims = run.workers(2)
    marks = log_marks(victims)
    batch_id = submit("kill", n)

    def victims_called() -> bool:
        return all(
            "succeeded prompt_tokens" in logs_since([v], [m])
            for v, m in zip(victims, marks, strict=True)
        )

    wait_until(victims_called, 60, "host 2's workers to run items")
    wait_until(lambda: succeeded_items(batch_id) >= 40, 60, "the run to get under way")
    # At the provider's limits every thread can be waiting on the budget at once: kill
    # only when the simulator holds a call of host 2 that began moments ago (an answer
    # takes CALL_MS), so that calls are cut mid-flight for certain.
    wait_until(lambda: fresh_call_from(run, 2), 30, "a call of host 2 in flight", poll_s=0.02)
    run.kill(2)
    done_at_kill = succeeded_items(batch_id)
    wait_batches([batch_id], timeout_s=90)

    report = check_invariants(
        run.sim.base_url, run.redis(), slot_grace_s=FAULT_RUNNING_LEASE_S, worker_killed=True
    )
    tokens, requests = assert_limits_held(run)
    cut = cut_calls(run.sim.base_url)
    print(
        f"\nmultihost kill: {done_at_kill}/{n} done at the kill, {cut} calls cut, "
        f"{report.retried_items} items retried, {report.waste_rows} waste rows, "
        f"final {report.statuses}; max window: tokens {tokens:.3f}x, requests {requests:.3f}x"
    )
    assert done_at_kill < n, "the run was over before the kill"
    assert cut >= 1, "no call of the killed host was in flight"
    assert report.statuses == {"succeeded": n}


def test_a_host_with_a_skewed_clock_breaks_no_budget_lease_or_deadline(run: Cluster) -> None:
    """Two hosts, host 3's wall clock five minutes ahead (libfaketime, both its workers;
    its beat sends the dispatch and sweep ticks, so leases are swept on the skewed host
    too). At the provider's limits, with a 60 s deadline that a clock five minutes
    ahead would see as long passed: the limits hold, every item succeeds once, none
    expires, and the skewed host ran its share."""
    offset = faketime_offset_s(run)
    assert abs(offset - SKEW_S) < 30, f"the skewed host's clock is {offset:.0f} s off"
    run.ensure([1, 3], skewed=3)
    n = 120
    everyone = run.workers(1) + run.workers(3)
    marks = log_marks(everyone)
    started = time.monotonic()
    batch_id = submit("skew", n, SKEW_MODEL, completion_window="60s")
    wait_batches([batch_id], timeout_s=90)
    took_s = time.monotonic() - started

    report = check_invariants(run.sim.base_url, run.redis())
    tokens, requests = assert_limits_held(run, SKEW_MODEL)
    logs = [logs_since([w], [m]) for w, m in zip(everyone, marks, strict=True)]
    by_skewed = sum(text.count("succeeded prompt_tokens") for text in logs[WORKERS_PER_HOST:])
    print(
        f"\nmultihost skew {SKEW}: {by_skewed}/{n} items run by the skewed host, "
        f"final {report.statuses} in {took_s:.1f} s, {swept_back(''.join(logs))} put back by "
        f"the sweep; max window: tokens {tokens:.3f}x, requests {requests:.3f}x"
    )
    assert report.statuses == {"succeeded": n}
    assert by_skewed > 0, "the skewed host ran no item"
    assert tokens >= NEAR_THE_LIMIT, "the two hosts did not run near the limit"
    # A budget wait's ETA is on Redis's clock and read in each host's frame
    # (app/worker/clock.py): no retry is held back until its lease runs out.
    lost = re.findall(r"item \d+: its \w+ lease ran out[^\n]*", "".join(logs))
    assert swept_back("".join(logs)) == 0, lost


# --- the skewed clock -------------------------------------------------------------------


def _libfaketime() -> str | None:
    for pattern in ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def _install_faketime() -> str:
    lib = _libfaketime()
    if lib is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (["apt-get", "install", "-y", "faketime"], ["apt-get", "update"]):
            subprocess.run(argv, capture_output=True, env=env, timeout=300)
            if argv[1] == "update":
                subprocess.run(
                    ["apt-get", "install", "-y", "faketime"],
                    capture_output=True,
                    env=env,
                    timeout=300,
                )
            lib = _libfaketime()
            if lib is not None:
                break
    if lib is None:
        _fail_or_skip("libfaketime is not installed (apt-get install faketime)")
    assert lib is not None
    return lib


def skew_env(folder: Path) -> dict[str, str]:
    """The environment that puts a process's wall clock SKEW ahead (and not its
    monotonic clock; see SLEEP_FIX)."""
    fix = folder / "faketime-fix"
    fix.mkdir(exist_ok=True)
    (fix / "sitecustomize.py").write_text(SLEEP_FIX)
    path = os.pathsep.join(p for p in (str(fix), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "LD_PRELOAD": _install_faketime(),
        "FAKETIME": SKEW,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": path,
    }


def faketime_offset_s(cluster: Cluster) -> float:
    """How far ahead a process started as the skewed workers are (in host 3) sees the
    wall clock, and that it can sleep and wait there."""
    probe = (
        "import threading, time; time.sleep(0.05); threading.Event().wait(0.05); print(time.time())"
    )
    env = {**_clean_environ(), **skew_env(cluster.log_dir)}
    before = time.time()
    out = subprocess.run(
        [IP, "netns", "exec", cluster.net.namespace(3), sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=True,
    ).stdout
    return float(out.strip()) - before
