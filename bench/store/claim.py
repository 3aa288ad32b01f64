"""Claim + complete throughput through the repository vs a raw SQL loop, same run.

4 claimer processes, 64 items per claim. The peer is the bare Postgres-queue pattern on the
same ``items`` table (same indexes): one ``UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP
LOCKED)`` to claim, one ``UPDATE`` to mark done. Backfill's path is what a worker does:
``open_claim`` (fair share between tenants, EDF within one, ``SKIP LOCKED``, the transaction
kept open where the worker counts tokens and reserves), ``start_claim`` (each item to running
under a new attempt with its lease id and fencing token, its attempt row and the counters, one
statement, then the commit) and ``finish`` (fenced results, attempt outcomes, counters).
``--tenants N`` spreads the items over N tenants' jobs; ``--plain-edf`` claims earliest deadline
first across tenants, without fair share.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import psycopg

from backfill.config import libpq_url
from backfill.states import ItemState, JobState
from backfill.store import Finish, NewItem, OpenClaim, Repository, Start
from bench.common import Stopwatch, finish, parser, scratch_database, table

NAME = "claim"
GOAL = 0.7
CLAIMERS = 4
PER_CLAIM = 64
FAIR_SHARE = True
"""How the repository claims (``--plain-edf`` turns it off; read by the forked claimers)."""
OK_RESULT = '{"ok": true}'
BODY = '{"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}'


def _load(url: str, n: int, tenants: int = 1) -> list[str]:
    repo = Repository.connect(url)
    try:
        jobs = []
        for t in range(tenants):
            tenant = repo.tenants.create_tenant(f"bench-{t}")
            f = repo.files.create_file(tenant.id, "batch", "in.jsonl", None, size_bytes=0)
            job = repo.jobs.create_job(
                tenant.id, f.id, "/v1/chat/completions", "24h",
                datetime.now(UTC) + timedelta(days=1, seconds=t),
            )  # fmt: skip
            share = n // tenants + (1 if t < n % tenants else 0)
            repo.ingest.insert_items(
                job.id, (NewItem(i, f"r{i}", BODY, 64, 20, 128) for i in range(share))
            )
            repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
            jobs.append(job.id)
        return jobs
    finally:
        repo.close()


def run_claim(
    repo: Repository,
    claim: OpenClaim,
    fence: int,
    lease_prefix: str,
    tokens: tuple[int, int],
    result: Callable[[int], str],
    output_tokens: int,
) -> tuple[int, int]:
    """What a worker does with an open claim, the engine left out: each item started under a
    new attempt (lease ``{lease_prefix}{fencing token}``, the tokens counting on from
    ``fence``, reserving ``tokens``: reservation and prompt), then finished succeeded with
    ``result(item id)``; returns the last fencing token and the items finished."""
    starts = []
    for c in claim.items:
        fence += 1
        starts.append(Start(c.id, c.attempt, f"{lease_prefix}{fence}", fence, *tokens))
    repo.claims.start_claim(claim, starts)
    done = repo.items.finish(
        [
            Finish(
                s.item_id,
                s.attempt,
                s.fencing_token,
                ItemState.SUCCEEDED,
                result=result(s.item_id),
                output_tokens=output_tokens,
            )
            for s in starts
        ]
    )
    return fence, len(done)


def _repo_claimer(url: str, worker: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    repo = Repository.connect(url, pool_size=1, fair_share=FAIR_SHARE)
    done = 0
    fence = worker << 40
    while True:
        claim = repo.claims.open_claim(f"node{worker}", PER_CLAIM, 30)
        if not claim.items:
            break
        # Here the worker counts tokens and reserves a lease per item, the claim still open.
        fence, finished = run_claim(
            repo, claim, fence, "l", (128, 20), lambda _: '{"ok": true}', 12
        )
        done += finished
    repo.close()
    out.put(done)


def _raw_claimer(url: str, worker: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    done = 0
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        while True:
            ids = [
                r[0]
                for r in conn.execute(
                    "UPDATE items SET state = 'running', node = %s WHERE id IN ("
                    "SELECT id FROM items WHERE state = 'queued' ORDER BY deadline, id "
                    "LIMIT %s FOR UPDATE SKIP LOCKED) RETURNING id",
                    (f"node{worker}", PER_CLAIM),
                ).fetchall()
            ]
            if not ids:
                break
            conn.execute(
                "UPDATE items SET state = 'succeeded', result = '{\"ok\": true}', "
                "output_tokens = 12 WHERE id = ANY(%s)",
                (ids,),
            )
            done += len(ids)
    out.put(done)


def _run(target: object, url: str) -> tuple[float, int]:
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=target, args=(url, w, out)) for w in range(CLAIMERS)]  # type: ignore[arg-type]
    with Stopwatch() as sw:
        for p in procs:
            p.start()
        total = sum(out.get() for _ in procs)
        for p in procs:
            p.join()
    return sw.seconds, total


def main() -> None:
    global FAIR_SHARE  # noqa: PLW0603 - set once, before the claimers fork
    p = parser(NAME, __doc__ or "")
    p.add_argument("--tenants", type=int, default=1, help="tenants the items are spread over")
    p.add_argument("--plain-edf", action="store_true", help="claim without fair share")
    args = p.parse_args()
    FAIR_SHARE = not args.plain_edf
    n = 12_000 if args.quick else 50_000
    results: dict[str, list[float]] = {"raw": [], "repo": []}
    for r in range(1 if args.quick else 2):
        for side in ("raw", "repo") if r % 2 == 0 else ("repo", "raw"):
            with scratch_database("bfclaim") as url:
                jobs = _load(url, n, args.tenants)
                secs, total = _run(_raw_claimer if side == "raw" else _repo_claimer, url)
                assert total == n, (side, total, n)
                if side == "repo":
                    check = Repository.connect(url)
                    done = sum(
                        check.jobs.get_job(None, j).counts.count(ItemState.SUCCEEDED) for j in jobs
                    )
                    check.close()
                    assert done == n
            results[side].append(n / secs)
    raw, repo = max(results["raw"]), max(results["repo"])
    print(
        table(
            ["path", "items", "tenants", "claimers", "per claim", "items/s (best)"],
            [
                ("raw SQL claim + done", n, args.tenants, CLAIMERS, PER_CLAIM, raw),
                (
                    "Backfill open_claim + start_claim + finish"
                    + (" (plain EDF)" if args.plain_edf else " (fair share)"),
                    n,
                    args.tenants,
                    CLAIMERS,
                    PER_CLAIM,
                    repo,
                ),
            ],
        )
    )
    finish(
        NAME,
        "ratio",
        repo / raw,
        ">=",
        GOAL,
        {
            "items": n,
            "tenants": args.tenants,
            "fair_share": FAIR_SHARE,
            "raw_items_per_s": raw,
            "repo_items_per_s": repo,
            "runs": results,
        },
    )


if __name__ == "__main__":
    main()
