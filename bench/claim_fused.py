"""Design probe for issue 21: what fusing the claim and the start into one transaction would
give, against the repository's path and the raw SQL loop, same run.

``bench.claim`` measures the worker's claim path as it is: a hold (``reserved``, attempt row
opened), a commit (``running`` with lease and fencing token, attempt row updated), a finish:
three transactions, two writes of each item and of its attempt row before the finish. The
probe's fused path picks the items ``FOR UPDATE SKIP LOCKED`` in a transaction it keeps open
(where the worker would count tokens and reserve leases), then starts them in one statement
(items, counters, each attempt row written once) and commits; the finish is the repository's
own. It is not the product's code: it measures whether the redesign is worth making (the held
transaction keeps row locks and a connection across the token count and the ledger call).
Plain EDF on all three sides (one tenant), 4 claimers, 64 items per claim.
"""

from __future__ import annotations

import multiprocessing as mp

import psycopg

from backfill.config import libpq_url
from backfill.states import ItemState
from backfill.store import Finish, Repository
from backfill.store.bodies import ITEM_BODY
from backfill.store.claims import CLAIMABLE_NOW
from backfill.store.counters import counters_cte, moved_from
from backfill.store.driver import array_literal, to_psycopg
from bench import claim
from bench.common import finish, parser, scratch_database, table

NAME = "claim_fused"
GOAL = claim.GOAL

PICK = (
    f"SELECT i.id, i.state, {ITEM_BODY} AS body, i.deadline, i.prompt_tokens, "
    "i.max_output_tokens, i.reservation_tokens, i.preemptions, i.partial_output, "
    "i.partial_tokens, EXTRACT(EPOCH FROM (i.deadline - now()))::float8 AS deadline_left_s, "
    "(SELECT endpoint FROM jobs j WHERE j.id = i.job_id) AS endpoint "
    f"FROM items i WHERE {CLAIMABLE_NOW.replace('items.job_id', 'i.job_id')} "
    "ORDER BY deadline, id LIMIT :n FOR UPDATE OF i SKIP LOCKED"
)
START = (
    "WITH v AS (SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:st AS text[]), "
    "CAST(:lid AS text[]), CAST(:fen AS bigint[]), CAST(:res AS int[]), CAST(:pt AS int[])) "
    "AS v(id, s, l, f, r, p)), "
    "moved AS (UPDATE items i SET state = 'running', attempt = i.attempt + 1, node = :node, "
    "  lease_id = v.l, fencing_token = v.f, not_before = NULL, reservation_tokens = v.r, "
    "  prompt_tokens = coalesce(v.p, i.prompt_tokens), "
    "  lease_expires_at = now() + make_interval(secs => :ttl), "
    "  started_at = coalesce(i.started_at, now()), updated_at = now() "
    "  FROM v WHERE i.id = v.id "
    "  RETURNING i.id, i.job_id, i.attempt, v.l, v.f, v.r, v.p, v.s AS from_state), "
    + counters_cte(
        {
            s.value: moved_from(s)
            for s in (ItemState.QUEUED, ItemState.DEFERRED, ItemState.PREEMPTED)
        }
        | {"running": "count(*)"}
    )
    + ", att AS (INSERT INTO attempts (item_id, attempt, node, lease_id, fencing_token, "
    "  reserved_tokens, prompt_tokens, started_at) "
    "  SELECT id, attempt, :node, l, f, r, p, now() FROM moved) "
    "SELECT id, attempt, f FROM moved"
)


def _fused_claimer(url: str, worker: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    repo = Repository.connect(url, pool_size=1)
    conn = psycopg.connect(libpq_url(url))
    done, fence, node = 0, worker << 40, f"node{worker}"
    while True:
        with conn.transaction():
            conn.execute("SET LOCAL synchronous_commit = off")
            picked = conn.execute(
                to_psycopg(PICK), {"n": claim.PER_CLAIM, "models": None}, prepare=True
            ).fetchall()
            if not picked:
                break
            picked.sort(key=lambda r: r[0])  # lock order
            # Here the worker would count tokens and reserve a lease per item.
            fences = list(range(fence + 1, fence + 1 + len(picked)))
            fence += len(picked)
            started = conn.execute(
                to_psycopg(START),
                {
                    "ids": array_literal(r[0] for r in picked),
                    "st": array_literal(r[1] for r in picked),
                    "lid": array_literal(f"l{f}" for f in fences),
                    "fen": array_literal(fences),
                    "res": array_literal(128 for _ in picked),
                    "pt": array_literal(20 for _ in picked),
                    "node": node,
                    "ttl": 30,
                },
                prepare=True,
            ).fetchall()
        done += len(
            repo.finish(
                [
                    Finish(i, a, f, ItemState.SUCCEEDED, result='{"ok": true}', output_tokens=12)
                    for i, a, f in started
                ]
            )
        )
    conn.close()
    repo.close()
    out.put(done)


def main() -> None:
    args = parser(NAME, __doc__ or "").parse_args()
    claim.FAIR_SHARE = False  # read by the forked claimers
    n = 12_000 if args.quick else 30_000
    sides = {"raw": claim._raw_claimer, "repo": claim._repo_claimer, "fused": _fused_claimer}
    results: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(1 if args.quick else 2):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for side in order:
            with scratch_database("bfclaimfused") as url:
                (job,) = claim._load(url, n)
                secs, total = claim._run(sides[side], url)
                assert total == n, (side, total, n)
                if side != "raw":
                    check = Repository.connect(url)
                    counts = check.get_job(None, job).counts
                    check.close()
                    assert counts.count(ItemState.SUCCEEDED) == n, counts
            results[side].append(n / secs)
    best = {side: max(v) for side, v in results.items()}
    raw = best["raw"]
    print(
        table(
            ["path", "items", "claimers", "per claim", "items/s (best)", "of raw"],
            [
                ("raw SQL claim + done", n, claim.CLAIMERS, claim.PER_CLAIM, raw, 1.0),
                *(
                    (label, n, claim.CLAIMERS, claim.PER_CLAIM, best[side], best[side] / raw)
                    for side, label in (
                        ("repo", "Backfill hold_claim + commit + finish (plain EDF)"),
                        ("fused", "probe: claim and start in one transaction + finish"),
                    )
                ),
            ],
        )
    )
    finish(
        NAME,
        "ratio",
        best["fused"] / raw,
        ">=",
        GOAL,
        {"items": n, "runs": results, "repo_ratio": best["repo"] / raw},
    )


if __name__ == "__main__":
    main()
