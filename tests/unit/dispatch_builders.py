"""Builders for the dispatcher's plans (``backfill.dispatch``): domain values made without
services, with defaults a test overrides only where it matters."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from backfill.dispatch import CheckedItem, FlightView, Limits, NodeView, RunPlan
from backfill.prefill import PromptCount
from backfill.store import ClaimedItem
from backfill.work_budget import WorkBudget

BLOCK = 16


def claimed(item_id: int = 1, **fields: Any) -> ClaimedItem:
    body = {"model": "m", "max_tokens": 64, "prompt": "hello"}
    item = ClaimedItem(
        id=item_id,
        job_id="job",
        attempt=1,
        custom_id=f"r{item_id}",
        body=json.dumps(body),
        deadline=datetime(2030, 1, 1, tzinfo=UTC) + timedelta(hours=1),
        prompt_tokens=None,
        max_output_tokens=64,
        reservation_tokens=None,
        preemptions=0,
        partial_output=None,
        partial_tokens=0,
        endpoint="/v1/completions",
        deadline_left_s=3600.0,
    )
    return replace(item, **fields)


def checked(
    item_id: int = 1,
    *,
    prompt: int = 100,
    sequences: int = 1,
    kept: int = 0,
    **item_fields: Any,
) -> CheckedItem:
    """A counted item whose run prefills ``prompt`` tokens per sequence."""
    item = claimed(item_id, **item_fields)
    count = PromptCount(prompt, prompt * sequences, sequences)
    return CheckedItem(item, RunPlan(json.loads(item.body), kept), count, prompt)


def flight(item_id: int = 1, **fields: Any) -> FlightView:
    base = FlightView(
        item_id=item_id,
        attempt=1,
        lease_id=f"ls_{item_id}",
        tokens=256,
        deadline_ms=None,
        preemptible=True,
        prompt_tokens=100,
        prefill_tokens=100,
        first_token_at=1.0,
    )
    return replace(base, **fields)


def prefilling_flight(item_id: int = 1, prompt: int = 100, **fields: Any) -> FlightView:
    """An attempt with no first token yet: its prompt counts against the prefill budget."""
    return flight(item_id, prefill_tokens=prompt, first_token_at=None, **fields)


def node(*flights: FlightView, **fields: Any) -> NodeView:
    return NodeView(flights=flights, **fields)


def budget(max_seqs: int = 8, max_prefill_tokens: int = 1024, *, hold: bool = False) -> WorkBudget:
    return WorkBudget(max_seqs, max_prefill_tokens, hold=hold)


LIMITS = Limits(
    max_sequence_tokens=4096,
    max_attempts=3,
    prefill_tokens_per_s=1000.0,
    decode_tokens_per_s=20.0,
)
