"""Which checked items lean on their shared prompt prefix, which reserve their whole prompt,
and which wait for the prefix to be cached (issue 36).

vLLM's prefix cache shares a prefix's blocks only once they are computed: requests that
prefill it side by side each compute, and hold, a copy of their own. So an item may lean on
a prefix the node's ledger holds once only where the engine will share it: prefix caching on,
one sequence, and the prefix known cached here (an attempt holding it has prefilled: its
first token came), or the item its **first holder** (nothing of it in flight here: it pays
the prefix's tokens in the ledger all the same, so it reserves what it would without
prefixes).

The rest of a group, claimed while its first holder prefills, **waits**: it goes back to the
queue untouched (no write, no attempt spent) and is claimed again once the first token is
back, to lean on the cached prefix then. Started beside the first, each would reserve (and
the engine hold) its whole prompt, and a wave of whole prompts that starts and ends together
leaves the next wave cold again (``bench.prefix`` read 1.44x, not 2x). The wait is bounded:
a first holder that has not prefilled within :data:`FIRST_PREFILL_WAIT_S` (queued behind
other work, stalled) no longer holds its group back, which then reserves whole prompts, as
without prefixes.

Never under-reserved: a waiting item does no engine work. A leaning item's lease names the
prefix, which the ledger holds for the node while any lease names it, whoever brought it in;
if the first holder fails or is preempted before it prefilled, it leaves the flights here,
nothing of its prefix is in flight, and the next item claimed becomes the first holder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from backfill.dispatch.checks import CheckedItem

FIRST_PREFILL_WAIT_S = 30.0
"""How long a prefix's group waits for its first holder's prefill before it reserves whole
prompts instead (a 1,000-token prefill takes well under a second on a GPU, seconds on a busy
CPU engine); the default of ``BACKFILL_PREFIX_FIRST_PREFILL_WAIT_S``."""

PREFIX_PASS_HOLD_S = 10.0
"""How long, at most, a node that looks for prefixes leaves a new job's items in the queue
while the job's prefix pass runs; the default of ``BACKFILL_PREFIX_PASS_HOLD_S``."""


def prefix_claim_hold_s(finds_prefixes: bool, hold_s: float) -> float | None:
    """How long this node's claims leave a job's items, from when the job went in progress,
    until the pass that looks for its shared prefixes has recorded them (it records a page at
    a time, in id order, and claims take the items behind it) or ended (None: not at all).

    Items claimed before the pass has recorded their prefix reserve their whole prompts, and
    start as a wave of whole prompts (``bench.prefix``: the first 9 of 48 items, ~17 s of a
    65 s run). Only a node that looks for prefixes waits: elsewhere no item could lean on one.
    The wait never outlasts ``hold_s``: a job no finder takes (its worker died, the finder is
    off on every node of its model) is claimed after it, as is one whose pass failed (marked
    ended). ``hold_s`` is seconds (the setting allows a minute at most), against deadlines of
    hours: the deadline check at claim time still sees the time left."""
    if not finds_prefixes or hold_s <= 0:
        return None
    return hold_s


@dataclass(frozen=True, slots=True)
class PrefixView:
    """What a node's dispatcher knows of the shared prompt prefixes on its engine.

    ``caching``: the engine keeps a prefix's blocks once for every request that starts with
    it (``enable_prefix_caching``). ``warm``: prefixes an attempt in flight here has prefilled
    (its first token came): their blocks are in the engine's cache, held by that attempt.
    ``busy``: prefixes of attempts in flight here, prefilled or not. ``cold_for_s``: for a
    busy prefix not warm, how long its oldest attempt in flight has been waiting for its
    first token."""

    caching: bool = False
    warm: frozenset[str] = frozenset()
    busy: frozenset[str] = frozenset()
    cold_for_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PrefixStarts:
    """``starting``: the items to reserve now, in the claim's order, with ``shares``: what of
    each one's reservation is its shared prefix (0: its whole prompt, as without prefixes),
    and ``cached``: what of each one's prompt the engine takes from its prefix cache instead
    of prefilling it (its share where an attempt here has prefilled the prefix; 0 for a
    first holder, which prefills it). ``waiting``: items that wait for their prefix's first
    holder to prefill (left in the queue, untouched)."""

    starting: tuple[CheckedItem, ...]
    shares: tuple[int, ...]
    waiting: tuple[CheckedItem, ...] = ()
    cached: tuple[int, ...] = ()


def shareable_tokens(checked: CheckedItem, block_size: int, caching: bool) -> int:
    """The tokens of ``checked``'s prompt the engine would share as its prefix: 0 where it
    would not (caching off, no prefix, several sequences, a prefix not shorter than the
    prompt: whole blocks shorter, so the item has blocks of its own)."""
    item = checked.item
    tokens = (item.prefix_blocks or 0) * block_size
    if (
        not caching
        or item.prefix_id is None
        or tokens < block_size
        or checked.count.sequences != 1
        or tokens >= checked.count.longest
    ):
        return 0
    return tokens


def plan_prefix_starts(
    checked: Sequence[CheckedItem],
    block_size: int,
    prefixes: PrefixView,
    *,
    wait_s: float = FIRST_PREFILL_WAIT_S,
) -> PrefixStarts:
    """Which of ``checked`` lean on their prefix, which reserve whole prompts, and which
    wait for their prefix's first holder (see the module's docstring)."""
    starting: list[CheckedItem] = []
    shares: list[int] = []
    cached: list[int] = []
    waiting: list[CheckedItem] = []
    first_here: set[str] = set()
    for c in checked:
        tokens = shareable_tokens(c, block_size, prefixes.caching)
        pid = c.item.prefix_id
        if tokens == 0 or pid is None or pid in prefixes.warm:
            # A warm prefix was prefilled by an attempt that still runs here: its blocks are
            # in the engine's cache, which computes only this prompt's own tokens.
            starting.append(c)
            shares.append(tokens)
            cached.append(tokens)
        elif pid in first_here or (
            pid in prefixes.busy and prefixes.cold_for_s.get(pid, 0.0) < wait_s
        ):
            waiting.append(c)
        elif pid in prefixes.busy:
            # Its first holder has not prefilled in time: started beside it, this item may
            # prefill its own copy of the prefix, so it reserves it whole.
            starting.append(c)
            shares.append(0)
            cached.append(0)
        else:
            first_here.add(pid)
            starting.append(c)
            shares.append(tokens)
            cached.append(0)
    return PrefixStarts(tuple(starting), tuple(shares), tuple(waiting), tuple(cached))
