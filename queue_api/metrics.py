"""``GET /metrics``: Prometheus text, without authentication (as scrapers expect).

It serves prometheus_client's default registry, one per process. Two kinds of metrics meet
there: those code records on the request path (the interactive gateway's, in
``queue_api.gateway_metrics``), and the scrape-time collector
(:class:`~backfill.telemetry.BackfillCollector`) that reads the deployment's Postgres and
ledger. The collector belongs to one app and is registered for that app's lifetime only
(:func:`attach` / :func:`detach` from its lifespan), so a process that creates many apps
(the tests) never reports a closed app's deployment. Its figures are reused for
``Settings.metrics_cache_s`` (:class:`CachedCollector`); the gateway's stay live.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from backfill.ledger import LedgerReadings
from backfill.store import QueueStats
from backfill.telemetry import BackfillCollector

router = APIRouter(tags=["metrics"])


class CachedCollector:
    """A collector's families, reused for ``ttl_s``: however often ``/metrics`` is called
    (it needs no key), Postgres and the ledger are read at most once per interval, and
    concurrent scrapes wait for one read instead of each making their own."""

    def __init__(
        self,
        inner: BackfillCollector,
        ttl_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self._ttl = ttl_s
        self._clock = clock
        self._families: list[Any] | None = None
        self._until = 0.0
        self._lock = threading.Lock()
        self.reads = 0

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        with self._lock:
            now = self._clock()
            if self._families is None or now >= self._until:
                self._families = list(self.inner.collect())
                self._until = now + self._ttl
                self.reads += 1
            return iter(self._families)


def attach(
    app: FastAPI, repo: QueueStats, ledger: LedgerReadings | None, cache_s: float = 0.0
) -> CachedCollector:
    """Registers ``app``'s scrape-time collector over its repository and ledger, its
    figures reused for ``cache_s``."""
    collector = CachedCollector(BackfillCollector(repo, ledger), cache_s)
    REGISTRY.register(collector)
    app.state.metrics_collector = collector
    return collector


def detach(app: FastAPI) -> None:
    collector: CachedCollector | None = getattr(app.state, "metrics_collector", None)
    if collector is not None:
        REGISTRY.unregister(collector)
        app.state.metrics_collector = None


@router.get("/metrics", include_in_schema=False)
def prometheus_metrics() -> Response:
    # A plain def: FastAPI runs it in a worker thread, where the collector's blocking
    # Postgres and Redis reads belong.
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
