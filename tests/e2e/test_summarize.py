"""A summarisation job on the real CPU engine, end to end: a Parquet file in through
``backfill summarize``, its long document (longer than the model's context) split with the
engine's tokenizer and map-reduced by the server into one summary, and a Parquet file of
summaries out through ``backfill results``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from backfill.config import Settings
from backfill.ledger import Ledger
from backfill.maintenance import pool_policy, tick
from backfill.store import Repository
from backfill.summarize import driver
from backfill.summarize.reduce_plan import plan_reduce
from backfill_cli.app import app
from tests.e2e.helpers import node_beside, node_settings, wait
from tests.integration.batch_api_support import LiveServer, make_tenant, serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

# About 8,000 tokens of the tiny model's tokenizer: several chunks of its 2,048-token context.
LONG = "\n\n".join(
    f"Section {i}. The committee met on day {i} and reviewed the harbour accounts. "
    f"Revenue from berth {i % 7} rose while dredging costs fell by {i % 5} percent. "
    "Members asked for a plan to replace the cranes before the winter storms."
    for i in range(120)
)


@contextmanager
def upkeep(settings: Settings) -> Iterator[None]:
    """Beat's work every 0.5 s in a thread: the maintenance tick and the reduce driver."""
    repo = Repository.connect(settings.database_url, pool_size=2)
    ledger = Ledger.from_url(
        settings.redis_url, settings.redis_namespace, pool_policy(settings), lease_ttl_ms=6000
    )
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.5):
            try:
                tick(repo, ledger, settings)
                driver.drive(repo, settings)
            except Exception:  # as under Celery beat: logged, and the next round runs
                logging.getLogger(__name__).exception("upkeep failed")

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
        ledger.close()
        repo.close()


def _cli(server: LiveServer, key: str, *args: str) -> tuple[int, str, str]:
    env = {"BACKFILL_API_URL": server.base_url, "BACKFILL_API_KEY": key, "COLUMNS": "160"}
    result = CliRunner().invoke(app, list(args), env=env, catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def test_a_parquet_file_with_a_long_document_is_summarised_into_a_parquet_file(
    settings: Settings, engine_url: str, tmp_path: Path
) -> None:
    s = node_settings(settings)
    with node_beside(s, "n1", engine_url) as nb, serve(s) as api:
        model = httpx.get(f"{engine_url}/v1/models", timeout=10).json()["data"][0]["id"]
        source = tmp_path / "docs.parquet"
        pq.write_table(
            pa.table(
                {
                    "doc": ["report", "memo", "note"],
                    "text": [LONG, "The memo asks for two new cranes.", "Storms are due."],
                }
            ),
            source,
        )
        tenant = make_tenant(nb.repo, "summaries")
        with upkeep(s):
            code, stdout, stderr = _cli(
                api,
                tenant.key,
                "summarize",
                str(source),
                "--model",
                model,
                "--text-column",
                "text",
                "--id-column",
                "doc",
                "--max-summary-tokens",
                "48",
                "--window",
                "1h",
            )
            assert code == 0, stderr
            job_id = stdout.strip()
            assert "3 documents (1 split, 0 not readable)" in stderr

            def ended() -> bool:
                return (
                    nb.repo.summary_jobs.get_summary_job(None, job_id).state.value != "in_progress"
                )

            wait(ended, 900, "the summary job to end")
        job = nb.repo.summary_jobs.get_summary_job(None, job_id)
        assert job.state.value == "completed", job

        output = tmp_path / "summaries.parquet"
        code, _, stderr = _cli(api, tenant.key, "results", job_id, "-o", str(output))
        assert code == 0, stderr
        rows = {r["id"]: r for r in pq.read_table(output).to_pylist()}
        report = rows["report"]
        assert report["error"] is None, report
        assert report["summary"]
        assert report["chunks"] > 1
        plan = plan_reduce(report["chunks"], job.fan_in)
        assert report["split_depth"] == plan.depth >= 1
        assert report["prompt_tokens"] > 2048  # its chunks were all read, more than one context
        for short in ("memo", "note"):
            assert rows[short]["error"] is None
            assert rows[short]["summary"]
            assert rows[short]["chunks"] == 1
