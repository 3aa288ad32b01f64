"""Fixtures most integration tests share: a repository over the test's own database, a live
API over it (``batch_api_support.serve``), and tenants with keys."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from batch_api_support import LiveServer, Tenant, api_settings, make_tenant, serve

from backfill.config import Settings
from backfill.store import Repository


@pytest.fixture
def repo(database_url: str) -> Iterator[Repository]:
    repository = Repository.connect(database_url)
    yield repository
    repository.close()


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
