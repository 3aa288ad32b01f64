"""The prompt prefixes a job's items share, in whole KV blocks (issue 36).

vLLM's prefix cache keeps a prompt's leading blocks once, shared by every running request
that starts with the same tokens (and the same ``cache_salt``: Backfill salts each tenant's
requests apart, ``backfill.cache_salt``). A job whose lines carry one instruction in front of
each document therefore holds that instruction once on a node, not once per item.

:func:`shared_prefixes` finds it from the items' token ids, as the engine tokenizes them
(``backfill.prefill``'s plan on the engine's ``/tokenize``): items are grouped by their first
block's tokens, and each group's prefix is the longest run of whole blocks every member
starts with. A group is worth keeping only with two items at least and one whole block.
A file with several instructions gives several groups.

A block counts as shared only where the engine can take it from its cache: vLLM computes a
prompt's last token again even on a full hit (it needs its logits), so an item shares at
most ``(len(prompt) - 1) // block_size`` blocks.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")

PREFIX_ID_CHARS = 32
"""Hex digits of a prefix id (128 bits of a SHA-256)."""


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """The shared prefix an item starts with: its id and its length in whole blocks."""

    id: str
    blocks: int

    def tokens(self, block_size: int) -> int:
        return self.blocks * block_size


def cacheable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Whole blocks of a prompt the engine can take from its prefix cache (the last token is
    always computed again)."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    return max(prompt_tokens - 1, 0) // block_size


def prefix_id(scope: str, model: str, tokens: Sequence[int]) -> str:
    """The id of a prefix: the same tokens of the same model in the same cache scope (the
    tenant, whose salt keeps its blocks apart) have the same id, whatever the job."""
    digest = hashlib.sha256()
    digest.update(f"{len(scope)}:{scope}|{len(model)}:{model}|".encode())
    digest.update(",".join(map(str, tokens)).encode())
    return digest.hexdigest()[:PREFIX_ID_CHARS]


class PrefixFinder(Generic[K]):
    """:func:`shared_prefixes` a prompt at a time: it keeps, per group, one run of tokens and
    its members' keys, not every prompt (a job of 50,000 items is not held in memory)."""

    def __init__(self, block_size: int, *, scope: str, model: str) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self.scope = scope
        self.model = model
        self._heads: dict[tuple[int, ...], list[int]] = {}
        self._members: dict[tuple[int, ...], list[K]] = {}

    def add(self, key: K, prompt: Sequence[int]) -> None:
        """One item's prompt (token ids, as the engine renders it)."""
        block = self.block_size
        limit = cacheable_blocks(len(prompt), block) * block
        if limit < 1:
            return
        first = tuple(prompt[:block])
        head = self._heads.get(first)
        if head is None:
            self._heads[first] = list(prompt[:limit])
            self._members[first] = [key]
            return
        length = min(len(head), limit)
        at = block  # the first block is the group's by construction
        while at < length and head[at] == prompt[at]:
            at += 1
        del head[at:]
        self._members[first].append(key)

    def found(self) -> dict[K, SharedPrefix]:
        """Each grouped item's prefix (an item not here shares none)."""
        found: dict[K, SharedPrefix] = {}
        for first, head in self._heads.items():
            members = self._members[first]
            blocks = len(head) // self.block_size
            if len(members) < 2 or blocks < 1:
                continue
            shared = SharedPrefix(
                prefix_id(self.scope, self.model, head[: blocks * self.block_size]), blocks
            )
            for key in members:
                found[key] = shared
        return found


def shared_prefixes(
    prompts: Sequence[Sequence[int] | None],
    block_size: int,
    *,
    scope: str,
    model: str,
) -> list[SharedPrefix | None]:
    """Each prompt's shared prefix (None: it shares none), in the order given.

    ``prompts`` are token ids, None for an item that cannot share (more than one prompt, an
    embedding, a prompt that could not be counted): it is left out of every group.
    """
    finder: PrefixFinder[int] = PrefixFinder(block_size, scope=scope, model=model)
    for at, prompt in enumerate(prompts):
        if prompt is not None:
            finder.add(at, prompt)
    found = finder.found()
    return [found.get(at) for at in range(len(prompts))]
