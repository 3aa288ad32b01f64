"""What a request reserves of a node's KV pool: pure values and functions, no I/O.

A request is charged its worst case, ``n * round_up(prompt + max_output)`` tokens
(:func:`reservation_tokens`), less a shared prompt prefix the ledger holds once for all its
leases; preemptible batch may opt in to being charged a measured fraction of its
``max_output_tokens`` (:class:`BatchOvercommit`). Which requests are admitted on what is
``backfill.policy``'s. The ledger's Lua scripts compute the same charges bit for bit (integer
millionths, :data:`PPM`), so a change here must be made in ``backfill/lua/`` too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from backfill.capacity import round_up_to_block

PPM = 1_000_000


@dataclass(frozen=True)
class BatchOvercommit:
    """Opt-in: charge preemptible batch for a measured fraction of ``max_output_tokens``.

    Most requests stop well before ``max_tokens``; charging the observed quantile of
    ``output / max_output`` lets more batch run. A request that outgrows its charge is the
    engine's to preempt, which is why only preemptible batch may be overcommitted and why it
    is never the default.
    """

    output_ratio_ppm: int
    """Charged part of ``max_output_tokens``, in millionths (1..1,000,000); integer so the Lua
    scripts compute the same charge bit for bit."""

    def __post_init__(self) -> None:
        if not 1 <= self.output_ratio_ppm <= PPM:
            raise ValueError("output_ratio_ppm must be in 1..1,000,000")

    @classmethod
    def from_ratio(cls, ratio: float) -> BatchOvercommit:
        return cls(min(PPM, max(1, math.ceil(ratio * PPM))))

    def charged_output(self, max_output_tokens: int) -> int:
        return (max_output_tokens * self.output_ratio_ppm + PPM - 1) // PPM


def overcommit_from_ratios(
    ratios: Iterable[float], quantile: float = 0.99, min_samples: int = 200
) -> BatchOvercommit | None:
    """An overcommit from observed ``output_tokens / max_output_tokens`` ratios.

    Returns ``None`` (no overcommit) with fewer than ``min_samples`` observations: a thin
    sample underestimates the tail, and the tail is what gets preempted.
    """
    if not 0 < quantile <= 1:
        raise ValueError("quantile must be in (0, 1]")
    values = sorted(min(1.0, max(0.0, r)) for r in ratios)
    if len(values) < min_samples or not values:
        return None
    # Nearest-rank quantile, rounded up: errs towards charging more.
    rank = max(1, math.ceil(quantile * len(values)))
    return BatchOvercommit.from_ratio(values[rank - 1])


def reservation_tokens(
    prompt_tokens: int,
    max_output_tokens: int,
    block_size: int,
    n: int = 1,
    *,
    prefix_tokens: int = 0,
) -> int:
    """The worst-case KV tokens a request can hold: ``n * round_up(prompt + max_output)``.

    With ``n > 1`` the engine forks ``n`` sequences of the same prompt. Their prompt blocks are
    shared only through prefix caching, which is an engine option and whose blocks can be
    evicted; so each sequence is charged its own copy of the prompt. Each sequence's blocks
    are rounded up separately because a block belongs to one sequence. An embedding generates
    nothing (``max_output_tokens == 0``): its prompt is all it holds.

    ``prefix_tokens``: whole blocks of a shared prompt prefix the node's ledger holds once for
    every lease that refers to it (issue 36; ``backfill.prefixes``): the request's own
    reservation leaves them out, the block that straddles the prefix's end counted whole
    (``round_up(prompt + max_output) - prefix_tokens``). One sequence only, and shorter than
    the prompt. The ledger's ``reserve`` script applies the same formula.
    """
    if prefix_tokens:
        if (
            n != 1
            or prefix_tokens < 0
            or block_size < 1
            or prefix_tokens % block_size
            or prefix_tokens >= prompt_tokens
        ):
            raise ValueError(
                "a shared prefix is whole blocks, shorter than the prompt, of one sequence"
            )
        whole = reservation_tokens(prompt_tokens, max_output_tokens, block_size)
        return whole - prefix_tokens
    if (
        prompt_tokens < 0
        or max_output_tokens < 0
        or prompt_tokens + max_output_tokens < 1
        or n < 1
        or block_size < 1
    ):
        raise ValueError(
            "need prompt_tokens >= 0, max_output_tokens >= 0, prompt + max_output >= 1, n >= 1, "
            "block_size >= 1"
        )
    return n * round_up_to_block(prompt_tokens + max_output_tokens, block_size)
