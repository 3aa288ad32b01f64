"""A real Redis Cluster for tests and benchmarks: masters (three by default), each with its
replicas (one by default), started from the installed ``redis-server`` (and ``redis-cli
--cluster create``) on free ports in a temporary directory, and stopped afterwards. Nothing
else is needed on the machine.

Nodes keep no data on disk (no RDB, no AOF), as the CI's single Redis; a failover therefore
promotes a replica with exactly what replication had delivered to it.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

NODE_TIMEOUT_MS = 1500
"""How long a master may be silent before the others mark it failed and its replica takes
over (Redis' ``cluster-node-timeout``): short, so a failover takes a few seconds."""


def _binary(name: str) -> str:
    found = shutil.which(os.environ.get(f"BACKFILL_TEST_{name.upper().replace('-', '_')}", name))
    if found is None:
        raise RuntimeError(f"{name} is not installed: the Redis Cluster tests start their own")
    return found


# Node ports (and their bus ports, port + 10000) lie below Linux's usual ephemeral range
# (32768 and up): an outgoing connection elsewhere on the machine cannot take one between the
# check here and the node's own bind. Nor do they meet the ports ``harness.free_port`` hands
# out (the 6,000 just below the ephemeral range).
_PORTS = range(10000, 16000)
_BUS_OFFSET = 10000


def _free_port(taken: Collection[int] = ()) -> int:
    """A port free now whose cluster bus port (port + 10000) is free too, neither of them in
    ``taken`` (ports and bus ports of nodes started but maybe not yet listening)."""
    for _ in range(200):
        port = random.choice(_PORTS)
        pair = (port, port + _BUS_OFFSET)
        if any(p in taken for p in pair):
            continue
        try:
            for p in pair:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


@dataclass
class Node:
    port: int
    folder: Path
    process: subprocess.Popen[bytes] | None = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=1)

    def info(self, section: str) -> dict[str, Any]:
        with self.client() as c:
            return dict(c.info(section))

    def cluster_state(self) -> str:
        with self.client() as c:
            info = c.execute_command("CLUSTER INFO")
        return str(dict(info).get("cluster_state"))

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class LocalCluster:
    """Masters and replicas on 127.0.0.1; ``url`` is what ``BACKFILL_REDIS_URL`` would say."""

    root: Path
    masters: int = 3
    replicas: int = 1
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])
        return f"redis+cluster://{seeds}"

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        """Start every node and form the cluster; a failure stops what was started."""
        try:
            return self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> LocalCluster:
        if self.masters < 3 and self.replicas:
            raise ValueError("a cluster of fewer than three masters is built without replicas")
        server = _binary("redis-server")
        cli = _binary("redis-cli")
        for i in range(self.masters * (1 + self.replicas)):
            folder = self.root / f"node{i}"
            folder.mkdir(parents=True)
            node = Node(_free_port(self._taken()), folder)
            self._launch(server, node)
            self.nodes.append(node)
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            what = f"redis-server on {node.port}"
            self._wait(partial(self._answers, server, node), deadline, what)
        if self.masters >= 3:
            self._create(cli, timeout_s)
        else:
            self._assign_slots()
        self.wait_healthy(deadline - time.monotonic())
        return self

    def _taken(self) -> set[int]:
        return {p for n in self.nodes for p in (n.port, n.port + _BUS_OFFSET)}

    @staticmethod
    def _launch(server: str, node: Node) -> None:
        node.process = subprocess.Popen(  # noqa: S603 - the installed binary, fixed flags
            [
                server,
                "--port", str(node.port),
                "--bind", "127.0.0.1",
                "--dir", str(node.folder),
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                # A replica takes over however long it was cut off (tests kill masters).
                "--cluster-replica-validity-factor", "0",
                # The shards that stay up keep serving while one is failing over.
                "--cluster-require-full-coverage", "no",
                "--save", "",
                "--appendonly", "no",
                "--maxmemory-policy", "noeviction",
                "--logfile", str(node.folder / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def _answers(self, server: str, node: Node) -> bool:
        """Whether ``node`` answers a ping; a node that exited before it did (its port taken
        by someone else between the check and its bind) starts again on another port."""
        if node.process is not None and node.process.poll() is not None:
            (node.folder / "nodes.conf").unlink(missing_ok=True)
            node.port = _free_port(self._taken())
            self._launch(server, node)
            return False
        return self._pings(node)

    def _create(self, cli: str, timeout_s: float) -> None:
        subprocess.run(  # noqa: S603 - the installed redis-cli, fixed flags
            [
                cli,
                "--cluster", "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas", str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )  # fmt: skip

    def _assign_slots(self) -> None:
        """What ``redis-cli --cluster create`` will not do under three masters: split the
        slots between the masters by hand and introduce them to one another."""
        per = 16384 // self.masters
        first = self.nodes[0]
        for i, node in enumerate(self.nodes):
            end = 16383 if i == self.masters - 1 else (i + 1) * per - 1
            with node.client() as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, end)
                if node is not first:
                    c.execute_command("CLUSTER", "MEET", "127.0.0.1", first.port)

    def stop(self) -> None:
        for node in self.nodes:
            if node.alive():
                assert node.process is not None
                node.process.terminate()
        for node in self.nodes:
            if node.process is not None:
                try:
                    node.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.process.kill()
                    node.process.wait(timeout=10)

    # -- health and topology

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive()]

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until every live node says ``cluster_state:ok``, sees the same masters (each slot
        served by a live master, the same one on every node), and every live replica is in
        sync with its master."""
        deadline = time.monotonic() + timeout_s
        self._wait(self._healthy, deadline, "the Redis Cluster to be healthy")

    def _healthy(self) -> bool:
        live = self.live()
        try:
            if any(n.cluster_state() != "ok" for n in live):
                return False
            roles = [n.info("replication") for n in live]
            views = [self._slot_owners(n) for n in live]
        except redis.RedisError:
            return False
        masters = {n.port for n, r in zip(live, roles, strict=True) if r.get("role") == "master"}
        if len(masters) != self.masters:
            return False
        # A promoted replica says it is a master before every other node has learned it: until
        # then a node still routes (and ``master_of`` still answers) its slots to the dead one.
        if any(v != views[0] for v in views) or {port for *_, port in views[0]} != masters:
            return False
        return all(r.get("master_link_status") == "up" for r in roles if r.get("role") == "slave")

    @staticmethod
    def _slot_owners(node: Node) -> set[tuple[int, int, int]]:
        """What ``node`` says of the slots: (first, last, port of the master serving them)."""
        with node.client() as c:
            return {
                (int(start), int(end), int(master[1]))
                for start, end, master, *_ in c.execute_command("CLUSTER SLOTS")
            }

    def master_of(self, key: str) -> Node:
        """The master that serves ``key``'s hash slot, as the live nodes see it now."""
        slot = key_slot(key.encode())
        for node in self.live():
            with contextlib.suppress(redis.RedisError), node.client() as c:
                for start, end, master, *_ in c.execute_command("CLUSTER SLOTS"):
                    if start <= slot <= end:
                        return next(n for n in self.nodes if n.port == int(master[1]))
        raise LookupError(f"no live node knows who serves slot {slot}")

    def replica_of(self, master: Node) -> Node:
        for node in self.live():
            info = node.info("replication")
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == master.port:
                return node
        raise LookupError(f"no live replica of {master.port}")

    def kill(self, node: Node) -> None:
        """SIGKILL: no goodbye to the cluster, as a crashed machine."""
        assert node.process is not None
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(timeout=10)

    def lose_keys(self, master: Node, pattern: str) -> int:
        """The shard loses its keys matching ``pattern`` (as a master restarted empty, its
        replica following), and no other shard loses any; returns how many went."""
        with master.client() as c:
            keys = list(c.scan_iter(match=pattern, count=1000))
            for key in keys:
                c.delete(key)
        return len(keys)

    # -- helpers

    @staticmethod
    def _pings(node: Node) -> bool:
        with contextlib.suppress(redis.RedisError), node.client() as c:
            return bool(c.ping())
        return False

    @staticmethod
    def _wait(check: Callable[[], bool], deadline: float, what: str) -> None:
        while True:
            if check():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.1)
