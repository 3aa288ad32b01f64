"""``backfill status`` on a summarisation job: what it says of a job still receiving."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from backfill_cli.summary_commands import render_summary_status


def _shown(job: dict[str, Any]) -> str:
    console = Console(width=160, record=True, color_system=None)
    console.print(render_summary_status(job, now=1_000.0))
    return console.export_text()


def test_a_job_started_before_its_last_document_says_more_are_being_sent() -> None:
    job: dict[str, Any] = {
        "id": "sumjob_x",
        "model": "m",
        "status": "in_progress",
        "documents_open": True,
        "progress": {"documents": {"pending": 3, "succeeded": 2}, "steps_done": 2,
                     "steps_planned": 5},
        "batches": ["batch_1"],
    }  # fmt: skip
    assert "3 pending, 2 succeeded, 0 failed, more being sent" in _shown(job)
    job["documents_open"] = False
    assert "more being sent" not in _shown(job)
