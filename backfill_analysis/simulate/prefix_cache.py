"""Shared prompt prefixes in the simulator (issue 36): the engine's prefix cache and the
node ledger's once-per-node reservation of a prefix.

:class:`PrefixCache` is vLLM's prefix cache as far as the simulator needs it: a prefix's whole
blocks, once a sequence has computed them, are held **once** while any resident sequence uses
them; a sequence admitted while they are cached skips their prefill and allocates none of them;
they are freed when the last user leaves (vLLM keeps them evictable instead: a later hit on
them is not modelled, which errs towards recomputing). Sequences that start while the prefix
is still being computed compute (and hold) a copy of their own, as in vLLM, where only
computed blocks are hit.

:class:`PrefixHolds` is the ledger side (``backfill.dispatch.prefix_starts``,
``backfill.reservations.reservation_tokens``): a node's prefix is reserved once while any lease
names it; each item reserves ``round_up(prompt + max_output) - prefix`` of its own; the first
holder of a group pays the prefix all the same, and the rest of its group **wait** for its first
token (the prefix cached) before they lean on it, at most
:data:`~backfill.dispatch.prefix_starts.FIRST_PREFILL_WAIT_S`, after which they reserve whole
prompts.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from backfill.dispatch.prefix_starts import FIRST_PREFILL_WAIT_S


def shareable_blocks(prompt_tokens: int, prefix_tokens: int, block_size: int) -> int:
    """The whole blocks of a ``prefix_tokens`` prefix the engine can take from its cache for a
    ``prompt_tokens`` prompt: vLLM computes a prompt's last token again even on a full hit, so
    at most ``(prompt - 1) // block_size`` (``backfill.prefixes``' rule)."""
    if prefix_tokens <= 0:
        return 0
    return max(0, min(prefix_tokens // block_size, (prompt_tokens - 1) // block_size))


class PrefixCache:
    """The engine's cached prefixes: key -> [blocks, resident users]."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, list[int]] = {}

    def cached(self, key: Hashable | None) -> int:
        """Blocks of ``key``'s prefix the cache holds now (0: none)."""
        if key is None:
            return 0
        entry = self._entries.get(key)
        return entry[0] if entry else 0

    def join(self, key: Hashable) -> None:
        """A sequence starts on the cached prefix."""
        self._entries[key][1] += 1

    def publish(self, key: Hashable, blocks: int) -> bool:
        """A sequence has computed ``blocks`` of ``key``'s prefix: they become the cached copy,
        shared from now on (True), unless a copy is cached already (False: it keeps its own)."""
        if key in self._entries or blocks <= 0:
            return False
        self._entries[key] = [blocks, 1]
        return True

    def leave(self, key: Hashable) -> int:
        """A user leaves; returns the blocks freed (the prefix's, when it was the last)."""
        entry = self._entries[key]
        entry[1] -= 1
        if entry[1] > 0:
            return 0
        del self._entries[key]
        return entry[0]

    @property
    def blocks(self) -> int:
        """Blocks all cached prefixes hold."""
        return sum(e[0] for e in self._entries.values())


@dataclass
class _Hold:
    tokens: int
    since_s: float
    holders: set[int] = field(default_factory=set)
    warm: set[int] = field(default_factory=set)
    """Holders whose first token came: the prefix is cached on the engine."""


class PrefixHolds:
    """The shared prefixes one node's ledger holds once, with the leases that name them."""

    def __init__(self, wait_s: float = FIRST_PREFILL_WAIT_S) -> None:
        self.wait_s = wait_s
        self._holds: dict[Hashable, _Hold] = {}
        self._named: dict[int, Hashable] = {}
        self.tokens = 0
        """Tokens all held prefixes reserve (they are in the batch ledger's use)."""
        self.epoch = 0
        """Bumped on every change: what a deferred admission's memo keys on."""

    def share(self, key: Hashable, tokens: int, now: float) -> int | None:
        """What an item of ``key``'s group with a ``tokens`` prefix may lean on now: ``tokens``
        (the prefix held once: warm, or this item its first holder), 0 (its first holder has
        not prefilled in time: reserve the whole prompt) or None (wait for that first
        token)."""
        hold = self._holds.get(key)
        if hold is None or hold.warm:
            return tokens
        return 0 if now - hold.since_s >= self.wait_s else None

    def held(self, key: Hashable) -> int:
        """The tokens of ``key``'s prefix the ledger holds already (0: none)."""
        hold = self._holds.get(key)
        return hold.tokens if hold else 0

    def take(self, lease: int, key: Hashable, tokens: int, now: float) -> int:
        """``lease`` names ``key``'s prefix; returns the tokens newly reserved for it (the
        prefix's, for its first holder; else 0)."""
        self.epoch += 1
        self._named[lease] = key
        hold = self._holds.get(key)
        if hold is not None:
            hold.holders.add(lease)
            return 0
        self._holds[key] = _Hold(tokens, now, {lease})
        self.tokens += tokens
        return tokens

    def first_token(self, lease: int) -> None:
        key = self._named.get(lease)
        if key is not None:
            self.epoch += 1
            self._holds[key].warm.add(lease)

    def release(self, lease: int) -> int:
        """``lease`` ended; returns the tokens freed (the prefix's, with its last holder)."""
        key = self._named.pop(lease, None)
        if key is None:
            return 0
        self.epoch += 1
        hold = self._holds[key]
        hold.holders.discard(lease)
        hold.warm.discard(lease)
        if hold.holders:
            return 0
        del self._holds[key]
        self.tokens -= hold.tokens
        return hold.tokens
