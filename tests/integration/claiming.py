"""Claims for tests, through the worker's one claim path (``Repository.claims.open_claim`` and
``start_claim``): items started or held as a worker starts or holds them, with no ledger and
no engine."""

from __future__ import annotations

from collections.abc import Sequence

from backfill.store import ClaimedItem, Repository, Start


def claim(
    repo: Repository,
    node: str,
    limit: int,
    lease_ttl_s: float = 30.0,
    *,
    leases: Sequence[tuple[str, int]] = (),
    reservation_tokens: int = 128,
    prompt_tokens: int = 100,
    models: Sequence[str] | None = None,
) -> list[ClaimedItem]:
    """Up to ``limit`` claimable items claimed for ``node``, each under its new attempt: the
    k-th starts (``running``) under ``leases[k]`` (lease id, fencing token), the rest are
    held (``reserved``, as the worker holds an item it refuses, to be settled: given back,
    deferred, expired or failed). Every start applies (the claim's jobs are in progress)."""
    opened = repo.claims.open_claim(node, limit, lease_ttl_s, models=models)
    if not opened.open:
        return []
    items = opened.items
    starts = [
        Start(c.id, c.attempt, lease_id, fence, reservation_tokens, prompt_tokens)
        for c, (lease_id, fence) in zip(items, leases, strict=False)
    ]
    held = [(c.id, c.attempt) for c in items[len(starts) :]]
    assert sorted(repo.claims.start_claim(opened, starts, held)) == sorted(
        s.item_id for s in starts
    )
    return items
