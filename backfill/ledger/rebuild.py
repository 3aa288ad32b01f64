"""Rebuilding the ledger after Redis lost its data, from the records Postgres keeps.

Redis is not durable. When it loses its data the ready marker goes with it, batch admission
closes (denial reason ``ledger_rebuilding``), and :func:`rebuild` restores the pools and the
live batch leases, then reopens admission.

On a Redis Cluster each node's keys, its ready marker among them, live in the node's own slot,
and the ledger's built marker and member set in one more: a shard that loses its data closes
the nodes it held (their markers are gone) while the member set, elsewhere, still names them,
so ``is_ready`` is false until a rebuild. Every step here is a command or a script on one slot;
the order of the steps, not one atomic call, keeps batch closed on every rebuilt node until all
of its leases are back.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from backfill import keys as lk
from backfill.errors import LedgerError
from backfill.ledger import operations
from backfill.ledger.calls import LedgerCalls, decoded
from backfill.ledger.steps import Command, Plan, chunks
from backfill.ledger.values import ActiveLease, NodePool, RebuildReport


def rebuild(
    calls: LedgerCalls,
    nodes: Sequence[NodePool],
    active_leases: Sequence[ActiveLease],
    epoch: int,
    *,
    now_ms: int | None = None,
    only: Collection[str] | None = None,
) -> Plan[RebuildReport]:
    """Restore pools and live batch leases from Postgres records, then reopen batch.

    With ``only`` (the nodes :func:`~backfill.ledger.operations.incomplete_nodes` names, and
    ``nodes``/``active_leases`` those of them Postgres knows), just those nodes are rebuilt:
    the rest of the fleet goes on admitting, and the built marker stays as it is.

    Batch admission is closed first and stays closed until every lease is back, so no
    batch lease is admitted against a ledger that is missing some. Interactive may use its
    reserve meanwhile. ``epoch`` must be larger than any epoch used before (the caller
    keeps it in Postgres); the epoch actually used is returned, possibly larger.
    """
    unknown = {a.node for a in active_leases} - {n.name for n in nodes}
    if unknown:
        raise LedgerError(f"active leases on nodes with no pool record: {sorted(unknown)}")
    keys = calls.keys
    if only is None:
        yield Command(("DEL", keys.built), int)
    elif {n.name for n in nodes} - set(only):
        raise LedgerError("a partial rebuild was given nodes outside those it rebuilds")
    for n in nodes:
        yield Command(("DEL", keys.node(n.name).ready), int)
    current: list[int] = []
    for n in nodes:
        found = yield Command(("HGET", calls.keys.pool(n.name), "epoch"), _same)
        if found is not None:
            current.append(int(found))
    chosen = rebuild_epoch(epoch, active_leases, current)
    for n in nodes:
        yield Command(("SADD", keys.members, n.name), int)
        yield from operations.register_pool(
            calls,
            n.name,
            n.capacity_tokens,
            n.block_size,
            epoch=chosen,
            reserve_tokens=n.interactive_reserve_tokens,
        )
    restored = skipped = 0
    for n in nodes:
        mine = [a for a in active_leases if a.node == n.name]
        for chunk in chunks(mine, lk.RESTORE_CHUNK):
            r, s = yield calls.restore(n.name, chunk, now_ms)
            restored += r
            skipped += s
    for n in nodes:
        yield Command(("SET", keys.node(n.name).ready, str(chosen)), bool)
    # A member left out of this rebuild (Postgres knows no such node) that lost its marker
    # and its pool has nothing to restore: it leaves the ledger, so readiness does not wait
    # on it forever. One with a pool stays: a node registering while this rebuild ran (not in
    # the Postgres rows it was given) is rebuilt by the next one, not dropped from the ledger.
    listed = {n.name for n in nodes}
    members: set[bytes] = yield Command(("SMEMBERS", keys.members), set)
    unlisted: list[str] = []
    for name in sorted(decoded(m) for m in members):
        if (only is not None and name not in only) or name in listed:
            continue
        if (yield Command(("EXISTS", keys.node(name).ready), bool)):
            continue
        if (yield Command(("EXISTS", keys.node(name).pool), bool)):
            unlisted.append(name)
        else:
            yield Command(("SREM", keys.members, name), int)
    if only is None:
        yield Command(("SET", keys.built, str(chosen)), bool)
    return RebuildReport(chosen, restored, skipped, tuple(unlisted))


def rebuild_epoch(epoch: int, active: Sequence[ActiveLease], current: Sequence[int]) -> int:
    """The epoch a rebuild uses: at least ``epoch``, and past every epoch already used."""
    # Fences handed out after the rebuild must exceed every fence handed out before it: those
    # Postgres recorded, and those of epochs Redis advanced to on its own (counter overflow).
    highest = max(
        [a.fencing_token // lk.FENCE_EPOCH_SHIFT for a in active] + list(current), default=0
    )
    chosen = max(epoch, highest + 1)
    if chosen > lk.MAX_EPOCH:
        raise LedgerError(f"epoch {chosen} exceeds {lk.MAX_EPOCH}")
    return chosen


def _same(reply: object) -> object:
    return reply
