"""A page of files costs the tenant's rate limit by its size: a token per 500 files (a page
of OpenAI's default 10,000 costs 20). A page of 10,000 costs the store and the API ~30 ms, as
much as ~20 small reads, and eight list loops of one tenant, well under its rate limit in
requests, raised another tenant's read p99 12-45-fold (``bench.isolation``, issue 35)."""

from __future__ import annotations

import httpx
from batch_api_support import api_settings, make_tenant, serve

from backfill.config import Settings
from backfill.store import Repository


def _codes(server_url: str, key: str, path: str, n: int) -> list[int]:
    with httpx.Client(
        base_url=server_url, headers={"Authorization": f"Bearer {key}"}, timeout=30
    ) as h:
        return [h.get(path).status_code for _ in range(n)]


def test_a_large_page_of_files_costs_more_of_the_rate_limit_than_a_small_one(
    settings: Settings, repo: Repository
) -> None:
    big, small = make_tenant(repo, "big"), make_tenant(repo, "small")
    # A slow bucket (a token every 20 s) of 45: what the test asks is all the burst.
    with serve(api_settings(settings, rate_limit_per_s=0.05, rate_limit_burst=45)) as server:
        url = server.base_url
        # The default page (10,000) costs 20: two go, the third is refused.
        assert _codes(url, big.key, "/v1/files", 3) == [200, 200, 429]
        # A page of 100 costs a token, as any read.
        assert _codes(url, small.key, "/v1/files?limit=100", 46) == [200] * 45 + [429]


def test_a_page_costing_more_than_the_whole_burst_still_goes_when_the_bucket_is_full(
    settings: Settings, repo: Repository
) -> None:
    tenant = make_tenant(repo, "tiny")
    with serve(api_settings(settings, rate_limit_per_s=0.05, rate_limit_burst=3)) as server:
        assert _codes(server.base_url, tenant.key, "/v1/files?limit=10000", 2) == [200, 429]
