"""Every Redis key name, channel and ledger constant in one place (as arq's ``constants.py``).

Key layout, with ``ns`` the deployment's namespace (``Settings.redis_namespace``) and ``node``
a node's name::

    {ns}:{ledger}:built              string   the epoch of the last finished rebuild; absent
                                              while the ledger is (re)built, and in a fresh or
                                              emptied Redis: ``is_ready`` is false
    {ns}:{ledger}:nodes              set      the nodes whose pools the ledger holds: a member
                                              whose pool vanished was lost (a shard lost data),
                                              not new, and waits for a rebuild
    {ns}:{ledger:node}:ready         string   the node's copy of the epoch: its ledger is
                                              complete (absent: batch admission on the node is
                                              closed until a rebuild restores it)
    {ns}:{ledger:node}:pool          hash     capacity, reserve, headroom, safety margin,
                                              class limits, overcommit, epoch, observed
                                              non-batch use, interactive and batch in use
                                              (and, for /metrics only, monotonic counts:
                                              ``denied:{class}:{reason}``, ``preemptions``)
    {ns}:{ledger:node}:leases        hash     lease id -> the live lease (msgpack array)
    {ns}:{ledger:node}:expiry        zset     lease id -> expiry (ms): the reaper's index
    {ns}:{ledger:node}:fence         string   fencing counter within the node's epoch
    {ns}:{ledger:node}:ended         hash     lease id -> "reason:fencing_token" of leases that
                                              ended lately (released, expired, preempted)
    {ns}:{ledger:node}:ended_at      zset     lease id -> when it ended (ms), for trimming
    {ns}:{ledger:node}:owners        hash     owner -> the interactive tokens its live leases
                                              hold (the gateway owns a tenant's leases as
                                              ``gateway/{tenant_id}``): what a tenant's share
                                              of the node is checked against; changed with
                                              the pool's interactive in use, by the same
                                              scripts, so the two never part (and counted
                                              again from the live leases by each ``reap``)
    {ns}:{ledger:node}:prefixes      hash     shared prompt prefix id -> 'tokens:holders': a
                                              prefix's tokens held once for every live lease
                                              that refers to it (issue 36)
    {ns}:preempt:{node}              channel  ids of batch leases preempted on that node
    {ns}:claimable                   channel  the model of a job whose items just became
                                              claimable: idle dispatchers of that model claim
                                              now, not at their next poll (``work_bell``)
    {ns}:work:signals:{node}         hash     gateway process id -> what it sees of interactive
                                              on that node (waiting, in prefill, recent TTFTs),
                                              JSON; short TTL (``backfill.work_signals``)
    {ns}:work:budget:{node}          hash     worker process id -> its batch work budget now, its
                                              use and why it last changed, JSON; read as the
                                              node's sum; short TTL
    {ns}:work:batch:{node}           hash     worker process id -> its batch sequences awaiting
                                              a first token, JSON; short TTL
    {ns}:engine:scheduler:{node}     string   what the node's engine scheduler (``backfill_vllm``)
                                              says of itself and did, JSON, as a worker last
                                              read it; short TTL (``backfill.engine_scheduler``)
    {ns}:ratelimit:...               hash     token buckets of the API edge (``backfill.ratelimit``)
    {ns}:keys:revoked                channel  digests of API keys just revoked: every API
                                              process evicts them from its key cache

``{ledger:node}`` is a Redis Cluster hash tag: every key of one node's ledger hashes to the
node's own slot, so each per-node script (``backfill/lua/``) runs on one shard, and nodes
spread over the shards of a cluster. The two ``{ledger}`` keys hash to a slot of their own;
no script touches them, the operations read and write them with plain commands. On one
Redis server the layout is the same and tags mean nothing. The namespace stays the first
segment so ``SCAN MATCH {ns}:*`` finds (and tests can delete) a deployment's keys. Scripts
only touch keys passed to them in KEYS. (Before the ledger ran on clusters every key shared
``{ledger}`` and the marker was ``{ns}:{ledger}:ready``; a Redis holding only that layout
reads as not built, so the first maintenance tick rebuilds it from Postgres.)
"""

from __future__ import annotations

from dataclasses import dataclass

HASH_TAG = "{ledger}"
"""The hash tag of the ledger's own keys (the rebuilt marker, the member set)."""

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
    owners: str
    channel: str
    prefixes: str = ""
    """Shared prompt prefixes held on the node (issue 36): prefix id -> 'tokens:holders'."""

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
            self.owners,
            self.prefixes,
        ]


@dataclass(frozen=True)
class LedgerKeys:
    """Key names of one namespace."""

    namespace: str

    @property
    def prefix(self) -> str:
        """The prefix of the ledger's own keys (not of any node's)."""
        return f"{self.namespace}:{HASH_TAG}"

    @property
    def built(self) -> str:
        return f"{self.prefix}:built"

    @property
    def members(self) -> str:
        return f"{self.prefix}:nodes"

    def node_prefix(self, node: str) -> str:
        # The tag ends at the first "}": a node name holding one still keeps all of its keys
        # in one slot (shared, at worst, with another such name).
        return f"{self.namespace}:{{ledger:{_check_node(node)}}}"

    def pool(self, node: str) -> str:
        return f"{self.node_prefix(node)}:pool"

    def preempt_channel(self, node: str) -> str:
        return f"{self.namespace}:preempt:{_check_node(node)}"

    def claimable_channel(self) -> str:
        return f"{self.namespace}:claimable"

    def node(self, node: str) -> NodeKeys:
        p = self.node_prefix(node)
        return NodeKeys(
            pool=f"{p}:pool",
            leases=f"{p}:leases",
            expiry=f"{p}:expiry",
            fence=f"{p}:fence",
            ended=f"{p}:ended",
            ended_at=f"{p}:ended_at",
            ready=f"{p}:ready",
            owners=f"{p}:owners",
            channel=self.preempt_channel(node),
            prefixes=f"{p}:prefixes",
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
        return f"{self.namespace}:{{ledger:*}}:pool"

    def node_from_pool_key(self, key: str) -> str:
        return key[len(f"{self.namespace}:{{ledger:") : -len("}:pool")]
