"""``/v1/capacity``: each node's pool and who holds it, and the queued work per class."""

from __future__ import annotations

from fastapi import APIRouter

from backfill.capacity_view import capacity_report
from queue_api.deps import RepositoryDep, TenantDep, UsageSourceDep
from queue_api.schemas import CapacityObject

router = APIRouter(prefix="/v1/capacity", tags=["capacity"])


@router.get("")
def capacity(_: TenantDep, repo: RepositoryDep, usage: UsageSourceDep) -> CapacityObject:
    return CapacityObject.of(capacity_report(repo, usage))
