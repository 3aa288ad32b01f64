"""``GET /metrics``: Prometheus text, without authentication (as scrapers expect).

It serves prometheus_client's default registry, one per process. Two kinds of metrics meet
there: those code records on the request path (the interactive gateway's, in
``queue_api.gateway_metrics``), and the scrape-time collector
(:class:`~backfill.telemetry.BackfillCollector`) that reads the deployment's Postgres and
ledger. The collector belongs to one app and is registered for that app's lifetime only
(:func:`attach` / :func:`detach` from its lifespan), so a process that creates many apps
(the tests) never reports a closed app's deployment.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from backfill.ledger import Ledger
from backfill.repository import Repository
from backfill.telemetry import BackfillCollector

router = APIRouter(tags=["metrics"])


def attach(app: FastAPI, repo: Repository, ledger: Ledger | None) -> BackfillCollector:
    """Registers ``app``'s scrape-time collector over its repository and ledger."""
    collector = BackfillCollector(repo, ledger)
    REGISTRY.register(collector)
    app.state.metrics_collector = collector
    return collector


def detach(app: FastAPI) -> None:
    collector: BackfillCollector | None = getattr(app.state, "metrics_collector", None)
    if collector is not None:
        REGISTRY.unregister(collector)
        app.state.metrics_collector = None


@router.get("/metrics", include_in_schema=False)
def prometheus_metrics() -> Response:
    # A plain def: FastAPI runs it in a worker thread, where the collector's blocking
    # Postgres and Redis reads belong.
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
