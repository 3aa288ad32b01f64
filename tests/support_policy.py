"""The pool policies the ledger and policy tests are written against, in one line each."""

from __future__ import annotations

from backfill.policy import ClassLimits, PoolPolicy


def pool_policy(
    interactive: int, batch: int, reserve: int, headroom: int, margin: int
) -> PoolPolicy:
    """A policy whose sequences may be ``interactive`` and ``batch`` tokens long (each class's
    limit), keeping ``reserve`` tokens for interactive work, ``headroom`` above its use and a
    safety margin of ``margin`` out of batch's reach."""
    return PoolPolicy(
        interactive=ClassLimits(interactive),
        batch=ClassLimits(batch),
        interactive_reserve_tokens=reserve,
        headroom_tokens=headroom,
        safety_margin_tokens=margin,
    )
