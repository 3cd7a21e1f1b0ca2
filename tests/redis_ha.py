"""Redis that can fail over, for the tests: a Redis Cluster (3 primaries, a replica
each) and a Sentinel setup (a primary, a replica, one Sentinel with quorum 1), real
``redis-server`` 7 processes on ports of their own, keeping nothing on disk.

The processes are children of the test process, so tests/reaper.py stops them
whatever ends the session; :meth:`stop` stops them first.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.sentinel import MasterNotFoundError, Sentinel

from batchgen.embedded import free_port
from batchgen.limits import redis_keys as keys
from tests.invariants import wait_until

REDIS_7 = "/usr/bin/redis-server"
REDIS_CLI = "/usr/bin/redis-cli"
NODE_TIMEOUT_MS = 1000  # cluster: a primary silent this long is failed over
DOWN_AFTER_MS = 1000  # sentinel: the same
MASTER = "mymaster"


def cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it) is free too."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def need_redis_7() -> None:
    if not (os.access(REDIS_7, os.X_OK) and shutil.which(REDIS_CLI)):
        pytest.skip(f"needs {REDIS_7} and {REDIS_CLI} (Redis 7)")


@dataclass
class Node:
    """One redis-server (or Sentinel: ``sentinel_conf``) on 127.0.0.1."""

    directory: Path
    args: list[str] = field(default_factory=list)
    sentinel_conf: str = ""
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> Node:
        self.directory.mkdir(parents=True, exist_ok=True)
        common = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory)]
        common += ["--logfile", str(self.directory / "redis.log")]
        if self.sentinel_conf:
            conf = self.directory / "sentinel.conf"
            conf.write_text(self.sentinel_conf)
            argv = [REDIS_7, str(conf), "--sentinel", *common]
        else:
            argv = [REDIS_7, *common, "--save", "", "--appendonly", "no", *self.args]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.started, 30, f"redis-server on port {self.port}")
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=1)

    def started(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"redis-server exited: see {self.directory / 'redis.log'}")
        return self.answers()

    def answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        """SIGKILL: the primary is gone at once, with what it had not replicated."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@dataclass
class ClusterSetup:
    """3 primaries with a replica each, made with ``redis-cli --cluster create``."""

    directory: Path
    nodes: list[Node] = field(default_factory=list)

    def start(self) -> ClusterSetup:
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        args += ["--cluster-node-timeout", str(NODE_TIMEOUT_MS)]
        self.nodes = [
            Node(self.directory / f"node{i}", args, port=cluster_port()).start() for i in range(6)
        ]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes)]
            + ["--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_until(self.ready, 30, "the cluster to be ok, a replica in sync for each primary")
        return self

    def ready(self) -> bool:
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                continue
            if node.client().execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                return False
        roles = [n.client().info("replication") for n in self.live()]
        in_sync = [r for r in roles if r["role"] == "slave" and r["master_link_status"] == "up"]
        return len(in_sync) == 3

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])

    def client(self) -> redis.Redis:
        nodes = [ClusterNode("127.0.0.1", n.port) for n in self.live()]
        cluster: redis.Redis = RedisCluster(startup_nodes=nodes, socket_timeout=2)  # type: ignore[assignment]
        return cluster

    def gate_primary(self) -> Node:
        """The primary serving the gate's slot (every budget and slot key)."""
        client = self.client()
        assert isinstance(client, RedisCluster)
        owner = client.nodes_manager.get_node_from_slot(key_slot(keys.GATE.encode()))
        return next(n for n in self.nodes if n.port == owner.port)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@dataclass
class SentinelSetup:
    """A primary, its replica and one Sentinel (quorum 1) watching them."""

    directory: Path
    primary: Node | None = None
    replica: Node | None = None
    sentinel: Node | None = None

    def start(self) -> SentinelSetup:
        self.primary = Node(self.directory / "primary").start()
        replica_of = ["--replicaof", "127.0.0.1", str(self.primary.port)]
        self.replica = Node(self.directory / "replica", replica_of).start()
        conf = "\n".join(
            [
                f"sentinel monitor {MASTER} 127.0.0.1 {self.primary.port} 1",
                f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}",
                f"sentinel failover-timeout {MASTER} 10000",
                "",
            ]
        )
        self.sentinel = Node(self.directory / "sentinel", sentinel_conf=conf).start()
        wait_until(self.ready, 30, "the Sentinel to know the replica, in sync")
        return self

    def ready(self) -> bool:
        assert self.sentinel is not None and self.replica is not None
        replicas = self.sentinel.client().sentinel_slaves(MASTER)
        link = self.replica.client().info("replication").get("master_link_status")
        return link == "up" and any("s_down" not in r["flags"] for r in replicas)

    @property
    def url(self) -> str:
        assert self.sentinel is not None
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{MASTER}/0"

    def primary_port(self) -> int | None:
        """The port of the primary as the Sentinel tells it; None while it has none."""
        assert self.sentinel is not None
        sentinel = Sentinel([("127.0.0.1", self.sentinel.port)], socket_timeout=2)
        try:
            return int(sentinel.discover_master(MASTER)[1])
        except MasterNotFoundError:
            return None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.primary_port(), socket_timeout=2)

    def stop(self) -> None:
        for node in (self.sentinel, self.replica, self.primary):
            if node is not None:
                node.stop()
