"""KV blocks as vLLM's cache manager holds them, read for the room interactive work needs
(``BackfillScheduler._make_room``): the blocks a step takes to start a waiting request, those
of its prompt running requests already hold (a shared prefix: they take no free block), and
those preempting a running request gives back to the free pool. vLLM's ``KVCacheManager`` and
``Request`` come in as they are (duck-typed): nothing here imports vLLM."""

from __future__ import annotations

from typing import Any


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up (vLLM's ``cdiv``)."""
    return -(a // -b)


def blocks_to_start(
    computed: int, chunk: int, lookahead: int, max_model_len: int, block_size: int, groups: int
) -> int:
    """Blocks a step allocates to give a request holding ``computed`` tokens its next
    ``chunk`` and the lookahead slots, less what it holds already, in every KV cache group."""
    ends = cdiv(min(computed + chunk + lookahead, max_model_len), block_size)
    return groups * max(0, ends - cdiv(computed, block_size))


def held_hits(manager: Any, request: Any) -> int:
    """Blocks of ``request``'s prompt that the prefix cache has and running requests hold:
    admitting it takes no free block for them (a cached block nobody holds sits in the free
    pool, and taking it takes a free block)."""
    if request.num_computed_tokens > 0 or not getattr(manager, "enable_caching", False):
        return 0
    if request.skip_reading_prefix_cache:
        return 0
    hit = manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
    return sum(1 for blocks in hit[0] for b in blocks if b.ref_cnt > 0 and not b.is_null)


def freed_blocks(manager: Any, request: Any) -> int:
    """KV blocks preempting ``request`` gives back to the free pool, in every group: only
    those it alone holds (a block shared with another running request, a common prefix in the
    prefix cache, stays held)."""
    groups = manager.coordinator.get_blocks(request.request_id)
    return sum(1 for blocks in groups for b in blocks if b.ref_cnt == 1 and not b.is_null)
