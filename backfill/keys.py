"""Every Redis key name, channel and ledger constant in one place (as arq's ``constants.py``).

Key layout, with ``ns`` the deployment's namespace (``Settings.redis_namespace``)::

    {ns}:{ledger}:ready              string   the epoch of the last finished rebuild; absent
                                              while the ledger is (re)built: batch admission
                                              is closed until it exists
    {ns}:{ledger}:pool:{node}        hash     capacity, reserve, headroom, safety margin,
                                              class limits, overcommit, epoch, observed
                                              non-batch use, interactive and batch in use
                                              (and, for /metrics only, monotonic counts:
                                              ``denied:{class}:{reason}``, ``preemptions``)
    {ns}:{ledger}:leases:{node}      hash     lease id -> the live lease (msgpack array)
    {ns}:{ledger}:expiry:{node}      zset     lease id -> expiry (ms): the reaper's index
    {ns}:{ledger}:fence:{node}       string   fencing counter within the node's epoch
    {ns}:{ledger}:ended:{node}       hash     lease id -> "reason:fencing_token" of leases that
                                              ended lately (released, expired, preempted)
    {ns}:{ledger}:ended_at:{node}    zset     lease id -> when it ended (ms), for trimming
    {ns}:preempt:{node}              channel  ids of batch leases preempted on that node
    {ns}:work:signals:{node}         hash     gateway process id -> what it sees of interactive
                                              on that node (waiting, in prefill, recent TTFTs),
                                              JSON; short TTL (``backfill.work_signals``)
    {ns}:work:budget:{node}          hash     worker process id -> its batch work budget now, its
                                              use and why it last changed, JSON; read as the
                                              node's sum; short TTL
    {ns}:engine:scheduler:{node}     string   what the node's engine scheduler (``backfill_vllm``)
                                              says of itself and did, JSON, as a worker last
                                              read it; short TTL (``backfill.engine_scheduler``)
    {ns}:keys:revoked                channel  digests of API keys just revoked: every API
                                              process evicts them from its key cache

The literal ``{ledger}`` is a Redis Cluster hash tag: every key of the ledger hashes to one
slot, so one script may touch the global ``ready`` marker and a node's keys together. The
ledger is small and each script is short, so one shard carries it easily. The namespace stays
the first segment so ``SCAN MATCH {ns}:*`` finds (and tests can delete) a deployment's keys.
Scripts only touch keys passed to them in KEYS.
"""

from __future__ import annotations

from dataclasses import dataclass

HASH_TAG = "{ledger}"

FENCE_EPOCH_SHIFT = 2**32
"""A fencing token is ``epoch * FENCE_EPOCH_SHIFT + counter``: the counter restarts after a
rebuild, the epoch (kept in Postgres by the caller) only grows, so tokens stay monotonic per
node across a loss of Redis data."""

MAX_EPOCH = 2**21 - 1
"""Lua numbers are doubles: ``epoch * 2**32 + counter`` is exact only below 2**53."""

MAX_INT = 2**53 - 1
"""The largest integer a script argument may carry (exact in a Lua double)."""

ENDED_TTL_MS = 15 * 60 * 1000
"""How long an ended lease is remembered (at least; ``reap`` forgets older ones). A release,
settle or heartbeat from its holder in this window is answered with why it ended; a rebuild
in this window will not resurrect it. It must exceed the longest rebuild."""

REAP_IN_RESERVE = 64
"""Expired leases a ``reserve`` call reclaims before admitting: bounded, so one call never
stalls Redis when a dead worker left thousands behind; the periodic reaper takes the rest."""

REAP_BATCH = 1000
"""Expired leases one ``reap`` call reclaims at most."""

BATCH_CHUNK = 100
"""Requests one batched reserve or release call decides at most (a call blocks Redis while it
runs: 100 reservations take a few milliseconds)."""

RESTORE_CHUNK = 500
"""Leases restored per script call during a rebuild (keeps each call short)."""


def key_revocations_channel(namespace: str) -> str:
    """The channel on which a revocation reaches every API process's key cache."""
    return f"{namespace}:keys:revoked"


def _check_node(node: str) -> str:
    if not node or len(node) > 200 or any(c.isspace() for c in node):
        raise ValueError(f"node name must be 1-200 characters without spaces: {node!r}")
    return node


@dataclass(frozen=True)
class NodeKeys:
    """The keys of one node's pool, in the order every per-node script takes them."""

    pool: str
    leases: str
    expiry: str
    fence: str
    ended: str
    ended_at: str
    ready: str
    channel: str

    def keys(self) -> list[str]:
        """KEYS for a per-node script (the channel is not a key; it travels in ARGV)."""
        return [
            self.pool,
            self.leases,
            self.expiry,
            self.fence,
            self.ended,
            self.ended_at,
            self.ready,
        ]


@dataclass(frozen=True)
class LedgerKeys:
    """Key names of one namespace."""

    namespace: str

    @property
    def prefix(self) -> str:
        return f"{self.namespace}:{HASH_TAG}"

    @property
    def ready(self) -> str:
        return f"{self.prefix}:ready"

    def pool(self, node: str) -> str:
        return f"{self.prefix}:pool:{_check_node(node)}"

    def preempt_channel(self, node: str) -> str:
        return f"{self.namespace}:preempt:{_check_node(node)}"

    def node(self, node: str) -> NodeKeys:
        _check_node(node)
        p = self.prefix
        return NodeKeys(
            pool=f"{p}:pool:{node}",
            leases=f"{p}:leases:{node}",
            expiry=f"{p}:expiry:{node}",
            fence=f"{p}:fence:{node}",
            ended=f"{p}:ended:{node}",
            ended_at=f"{p}:ended_at:{node}",
            ready=self.ready,
            channel=self.preempt_channel(node),
        )

    def work_signals(self, node: str) -> str:
        # Not in the ledger's hash slot: no script touches it, and the gateway writes it often.
        return f"{self.namespace}:work:signals:{_check_node(node)}"

    def work_budget(self, node: str) -> str:
        return f"{self.namespace}:work:budget:{_check_node(node)}"

    def engine_scheduler(self, node: str) -> str:
        return f"{self.namespace}:engine:scheduler:{_check_node(node)}"

    def work_batch(self, node: str) -> str:
        # One field per worker of the node: its batch sequences awaiting a first token.
        return f"{self.namespace}:work:batch:{_check_node(node)}"

    @property
    def pool_pattern(self) -> str:
        """SCAN pattern of every pool hash of the namespace."""
        return f"{self.prefix}:pool:*"

    def node_from_pool_key(self, key: str) -> str:
        return key[len(f"{self.prefix}:pool:") :]
