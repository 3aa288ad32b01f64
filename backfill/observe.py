"""Engine-observed non-batch KV use: interactive load that bypassed the gateway.

The ledger knows what the gateway reserved (I) and what batch reserved (B). Traffic sent
straight to the engine is invisible to it, yet it holds KV blocks and competes with batch all
the same. Each node's worker therefore reports

    O = allocated - batch_physical

where ``allocated`` is the engine's ``kv_cache_usage_perc x capacity`` (block-granular) and
``batch_physical`` estimates what batch leases hold in the engine: each sequence's prompt plus
the tokens generated so far, rounded up to whole blocks. The ledger's batch slack then guards
``max(I, O)`` rather than I alone (``backfill.policy.batch_slack``).

The estimate leans towards counting too much as batch only where the worker cannot know
better: a batch lease this worker does not hold (another worker on the same node) is counted
at its full reservation, its largest possible footprint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from backfill.capacity import round_up_to_block
from backfill.ledger import Lease, PoolSnapshot
from backfill.policy import ServiceClass


def allocated_tokens(kv_usage_fraction: float, capacity_tokens: int, block_size: int) -> int:
    """KV tokens the engine holds now: the used share of its blocks, in whole blocks."""
    blocks = capacity_tokens // block_size
    used = min(blocks, max(0, round(kv_usage_fraction * blocks)))
    return used * block_size


def engine_held_tokens(kv_usage_fraction: float, capacity_tokens: int, block_size: int) -> int:
    """KV tokens the engine's sequences hold now, as exactly as its gauge tells: vLLM (v1)
    keeps one block of its pool aside (the null block) and reports ``kv_cache_usage_perc`` as
    used blocks over the others, so ``usage x blocks`` overstates by up to one block.
    :func:`allocated_tokens` keeps that margin (it narrows batch slack, the safe side); the
    invariant's check needs the figure itself."""
    blocks = capacity_tokens // block_size
    usable = max(blocks - 1, 1)
    used = min(usable, max(0, round(kv_usage_fraction * usable)))
    return used * block_size


def batch_physical_tokens(
    leases: Iterable[Lease], in_engine: Mapping[str, int], block_size: int
) -> int:
    """What live batch leases hold in the engine.

    ``in_engine`` maps the lease ids whose sequences this worker knows to their prompt +
    generated tokens; any other batch lease counts at its reservation (an upper bound).
    """
    total = 0
    prefixes: dict[str, int] = {}
    for lease in leases:
        if lease.service_class is not ServiceClass.BATCH:
            continue
        if lease.prefix_id is not None:
            # A shared prefix's blocks are held once, whoever refers to them (issue 36); a
            # lease's own blocks are what its sequence holds past them.
            prefixes[lease.prefix_id] = lease.prefix_tokens
        known = in_engine.get(lease.lease_id)
        if known is None:
            total += lease.tokens
        else:
            own = round_up_to_block(known, block_size) - lease.prefix_tokens
            total += min(lease.tokens, max(0, own))
    return total + sum(prefixes.values())


def reserved_around(before: PoolSnapshot, after: PoolSnapshot) -> int:
    """What the ledger reserved on a node around an engine reading taken between two of its
    snapshots: every lease and shared prefix of either, once. A sequence the engine holds at
    the reading was reserved before it and is released after it (reserve, then send; free,
    then release), so it is in one snapshot or the other unless its whole life fell between
    them; one snapshot alone would miss the leases begun or ended meanwhile."""
    leases = {x.lease_id: x.tokens for x in before.leases}
    leases.update({x.lease_id: x.tokens for x in after.leases})
    prefixes = {p.prefix_id: p.tokens for p in before.prefixes}
    prefixes.update({p.prefix_id: p.tokens for p in after.prefixes})
    return sum(leases.values()) + sum(prefixes.values())


def allocated_over_reserved(allocated: int, reserved: int) -> int:
    """KV tokens the engine holds above what the ledger reserved on its node (0 while the
    invariant holds): every sequence the engine runs is under a lease, whose reservation
    covers its worst case, and a shared prefix is held by the ledger as long as one lease
    refers to it."""
    return max(0, allocated - reserved)


def observed_non_batch(
    kv_usage_fraction: float,
    capacity_tokens: int,
    block_size: int,
    leases: Iterable[Lease],
    in_engine: Mapping[str, int],
) -> int:
    """``O``: engine-allocated KV tokens that no batch lease accounts for (never negative)."""
    allocated = allocated_tokens(kv_usage_fraction, capacity_tokens, block_size)
    return max(0, allocated - batch_physical_tokens(leases, in_engine, block_size))
