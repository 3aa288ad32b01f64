"""Fixtures most integration tests share: a repository over the test's own database, a live
API over it (``batch_api_support.serve``), tenants with keys, and the ledger a maintenance
tick takes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from batch_api_support import LiveServer, Tenant, api_settings, make_tenant, serve

from backfill.config import Settings
from backfill.ledger import Ledger
from backfill.maintenance import pool_policy
from backfill.store import Repository
from tests.integration.support_summary_counts import kept_counts_differ


@pytest.fixture
def repo(database_url: str) -> Iterator[Repository]:
    repository = Repository.connect(database_url)
    yield repository
    repository.close()


@pytest.fixture
def summary_counts_checked(database_url: str) -> Iterator[None]:
    """After the test, every summary job's kept counts are its rows' counts (the summary test
    modules use it: every way their jobs' documents and steps move is checked)."""
    yield
    assert kept_counts_differ(database_url) == {}, "a job's kept counts drifted from its rows"


@pytest.fixture
def server(settings: Settings) -> Iterator[LiveServer]:
    with serve(api_settings(settings)) as live:
        yield live


@pytest.fixture
def acme(repo: Repository) -> Tenant:
    return make_tenant(repo, "acme")


@pytest.fixture
def other(repo: Repository) -> Tenant:
    return make_tenant(repo, "other")


@pytest.fixture
def tick_ledger(settings: Settings) -> Iterator[Ledger]:
    """The sync ledger a maintenance tick takes, over the test's Redis namespace with the
    pool policy of ``settings``."""
    client = redis.Redis.from_url(settings.redis_url)
    ledger = Ledger(client, settings.redis_namespace, pool_policy(settings))
    yield ledger
    ledger.close()


@pytest.fixture
def hook_settings(settings: Settings) -> Settings:
    """Webhooks: deliveries to 127.0.0.1 allowed (the receiver), retries quick, leases
    short."""
    return api_settings(
        settings,
        webhooks_allow_private=True,
        webhooks_retry_base_s=0.2,
        webhooks_retry_max_delay_s=0.5,
        webhooks_timeout_s=2.0,
        webhooks_lease_s=5.0,
        webhooks_poll_s=0.1,
    )
