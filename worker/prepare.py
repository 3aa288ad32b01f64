"""What one claimed item will run, decided before any engine work: its own request or, after
a preemption, the request that continues from its partial output (``resume_request``).

The checks that follow (class limit, deadline) and the values they pass are the core's
(``backfill.dispatch.checks``); continuing a request is the worker's (``worker.engine``).
"""

from __future__ import annotations

import json

from backfill.dispatch import RunPlan
from backfill.store import ClaimedItem
from worker.engine import ResumeUnsupported, resumable, resume_request

__all__ = ["RunPlan", "run_plan"]


def run_plan(item: ClaimedItem, *, from_start: bool = False) -> RunPlan:
    """The request ``item``'s next attempt sends: its own, or (with partial output and
    unless ``from_start``) its continuation. Raises ``ValueError`` for a body that is not a
    JSON object."""
    body = json.loads(item.body)
    if not isinstance(body, dict):
        raise ValueError("the stored request body is not a JSON object")
    done = item.partial_tokens
    if from_start or not done or not resumable(item.endpoint):
        # A Responses item's earlier output is not kept: it runs whole again.
        return RunPlan(body, 0)
    if done >= item.max_output_tokens:
        return RunPlan(body, done, complete=True)
    try:
        return RunPlan(resume_request(item.endpoint, body, item.partial_output or "", done), done)
    except ResumeUnsupported:
        # Continuing would change the answer's meaning: run it whole again.
        return RunPlan(body, 0)
