"""Redis that fails over mid-run: the workers' budgets, slots, leases and locks on a
real Redis Cluster (3 primaries, a replica each; ``redis+cluster://``) and on a real
Sentinel setup (``redis+sentinel://``); the primary that holds them is SIGKILLed
while a batch runs on the simulator. The broker is a plain Redis of the module's own
(Celery's transport takes neither form; docs/operations.md, "High availability").

Each test proves that the failover happened (another node is the primary), then
checks the shared invariants (:func:`tests.invariants.check_invariants`): every item
once, every billed call ledgered, no window over the limit, no slot left held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import redis

from tests import helpers
from tests.helpers import sim_config, submit_items, succeeded_items, wait_mid_run
from tests.integration.test_faults_redis import OwnRedis, _wait_supervised
from tests.invariants import check_invariants, reset_simulator, wait_until
from tests.redis_ha import ClusterSetup, SentinelSetup, need_redis_7

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ITEMS = 40
LEASE_S = helpers.FAULT_RUNNING_LEASE_S


@pytest.fixture
def sim(simulator: Any, clean_db: dict[str, str]) -> Iterator[Any]:
    reset_simulator(simulator.base_url)
    sim_config(simulator.base_url, latency_base_ms=300)
    yield simulator
    sim_config(simulator.base_url, latency_base_ms=50)


@pytest.fixture
def broker(tmp_path: Any) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path / "broker")
    server.start()
    yield server
    server.server.stop()


def _started(setup: Any) -> Iterator[Any]:
    need_redis_7()
    try:
        yield setup.start()
    finally:
        setup.stop()  # also the nodes a failed start left


@pytest.fixture
def cluster(tmp_path: Any) -> Iterator[ClusterSetup]:
    yield from _started(ClusterSetup(tmp_path / "cluster"))


@pytest.fixture
def sentinel(tmp_path: Any) -> Iterator[SentinelSetup]:
    yield from _started(SentinelSetup(tmp_path / "sentinel"))


def _kill_mid_run(
    sim: Any,
    workers: Any,
    broker: OwnRedis,
    redis_url: str,
    kill: Callable[[], None],
    client: Callable[[], redis.Redis],
) -> None:
    """Run a batch with the workers' budgets and slots on ``redis_url``, ``kill()`` its
    primary (and wait for the failover) once the run is under way, see the batch to
    its end, and check the invariants on the Redis that ``client()`` reaches then."""
    batch_id = submit_items("ha", ITEMS)
    start = partial(workers, env={**broker.env(), "REDIS_URL": redis_url})
    worker = start(name="worker")
    wait_mid_run(sim.base_url, batch_id)
    kill()
    assert succeeded_items(batch_id) < ITEMS, "the run was over before the kill"
    _wait_supervised(batch_id, worker, lambda name: start(name=name))
    report = check_invariants(sim.base_url, client(), slot_grace_s=LEASE_S)
    assert report.statuses == {"succeeded": ITEMS}


def test_cluster_primary_killed_mid_run(sim, workers, broker, cluster):
    """The primary serving the gate's slot is SIGKILLed; its replica takes over."""

    def kill() -> None:
        victim = cluster.gate_primary()
        assert int(victim.client().dbsize()) > 0, "no gate keys on the primary"
        victim.kill()
        wait_until(lambda: cluster.gate_primary() is not victim, 30, "a replica to take over")

    _kill_mid_run(sim, workers, broker, cluster.url, kill, cluster.client)


def test_sentinel_primary_killed_mid_run(sim, workers, broker, sentinel):
    """The primary is SIGKILLed; the Sentinel promotes the replica and the workers'
    clients ask it where the primary is now."""
    assert sentinel.primary is not None and sentinel.replica is not None
    primary, replica_port = sentinel.primary, sentinel.replica.port

    def kill() -> None:
        assert int(primary.client().dbsize()) > 0, "no keys on the primary"
        primary.kill()
        wait_until(lambda: sentinel.primary_port() == replica_port, 30, "the replica promoted")

    _kill_mid_run(sim, workers, broker, sentinel.url, kill, sentinel.client)
