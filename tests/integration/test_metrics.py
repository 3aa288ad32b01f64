"""``GET /metrics``: figures computed at scrape time from Postgres and the ledger."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from batch_api_support import (
    LiveServer,
    Tenant,
    chat_file,
    run_worker,
)
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backfill.config import Settings
from backfill.ledger import Ledger, NodePool
from backfill.store import Repository
from backfill.telemetry import BackfillCollector

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def ledger(settings: Settings) -> Iterator[Ledger]:
    led = Ledger.from_url(settings.redis_url, settings.redis_namespace)
    yield led
    led.close()


def submit(server: LiveServer, key: str, n: int) -> str:
    client = server.client(key)
    uploaded = client.files.create(file=("in.jsonl", chat_file(n)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="2h"
    )
    return batch.id


def busy_node(repo: Repository, ledger: Ledger) -> None:
    """gpu-0: 16,000 tokens, 4,000 reserved for interactive; one lease of each class, a
    denial of each class, and one batch lease preempted."""
    repo.nodes.upsert_node("gpu-0", "http://engine:8001", "tiny-model", 1000, 16, 4000)
    ledger.rebuild([NodePool("gpu-0", 16_000, 16, 4000)], [], epoch=1)
    ledger.reserve("gpu-0", "interactive", 1000, 500)
    ledger.reserve("gpu-0", "batch", 2000, 1000)
    ledger.reserve("gpu-0", "batch", 8000, 1000)  # fits the pool, not the slack left
    ledger.reserve("gpu-0", "batch", 40_000, 1000)  # over the batch class limit
    ledger.reserve("gpu-0", "batch", 100, 100, lease_id="ls_victim")
    ledger.preempt("gpu-0", 100, victims=["ls_victim"])


def test_metrics_need_no_key_and_report_queue_jobs_and_pools(
    server: LiveServer, acme: Tenant, repo: Repository, ledger: Ledger
) -> None:
    submit(server, acme.key, 5)
    run_worker(repo, fail={"req-1"}, limit=3, leave_running=1)
    busy_node(repo, ledger)

    response = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    s = parse(response.text)

    assert value(s, "backfill_metrics_source_up", source="postgres") == 1
    assert value(s, "backfill_metrics_source_up", source="ledger") == 1
    # 5 items: 1 succeeded, 1 failed, 1 running, 2 still queued.
    assert value(s, "backfill_items", **{"class": "batch", "state": "queued"}) == 2
    assert value(s, "backfill_items", **{"class": "batch", "state": "running"}) == 1
    assert value(s, "backfill_items", **{"class": "batch", "state": "preempted"}) == 0
    assert value(s, "backfill_items", **{"class": "interactive", "state": "running"}) == 1
    assert value(s, "backfill_items_finished_total", state="succeeded") == 1
    assert value(s, "backfill_items_finished_total", state="failed") == 1
    assert value(s, "backfill_jobs", state="in_progress") == 1
    assert value(s, "backfill_jobs", state="completed") == 0
    assert value(s, "backfill_deadline_misses_total", scope="item") == 0
    assert value(s, "backfill_queued_tokens", **{"class": "batch"}) > 0

    node = {"node": "gpu-0"}
    assert value(s, "backfill_kv_tokens", kind="capacity", **node) == 16_000
    assert value(s, "backfill_kv_tokens", kind="interactive_reserve", **node) == 4000
    assert value(s, "backfill_kv_tokens", kind="interactive_reserved", **node) == 1504
    assert value(s, "backfill_kv_tokens", kind="batch_reserved", **node) == 3008
    assert value(s, "backfill_kv_tokens", kind="engine_observed_non_batch", **node) == 0
    assert value(s, "backfill_kv_tokens", kind="slack", **node) == 16_000 - 4000 - 3008
    assert value(s, "backfill_leases", **{"class": "batch"}, **node) == 1
    assert (
        value(
            s, "backfill_allocation_denials_total", reason="no_slack", **{"class": "batch"}, **node
        )
        == 1
    )
    assert (
        value(
            s,
            "backfill_allocation_denials_total",
            reason="over_class_limit",
            **{"class": "batch"},
            **node,
        )
        == 1
    )
    assert value(s, "backfill_preemptions_total", **node) == 1
    assert value(s, "backfill_interactive_owner_recounts_total", **node) == 0
    assert value(s, "backfill_useful_tokens_per_second", window_s="60") == pytest.approx(3 / 60)
    # Histograms exist from the first scrape (their window trails now by a moment).
    assert ("backfill_output_tokens_count", ()) in s


def test_token_histograms_add_what_finished_since_the_last_scrape(
    settings: Settings, server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    collector = BackfillCollector(repo, None, lag_s=0.0, token_buckets=(2, 4, 32))
    registry = CollectorRegistry()
    registry.register(collector)

    submit(server, acme.key, 3)
    run_worker(repo, limit=2)  # 2 succeed with 16 prompt and 3 output tokens each
    s = parse(generate_latest(registry).decode())
    assert value(s, "backfill_output_tokens_count") == 2
    assert value(s, "backfill_output_tokens_sum") == 6
    assert value(s, "backfill_output_tokens_bucket", le="2.0") == 0
    assert value(s, "backfill_output_tokens_bucket", le="4.0") == 2
    assert value(s, "backfill_prompt_tokens_bucket", le="4.0") == 0
    assert value(s, "backfill_prompt_tokens_bucket", le="32.0") == 2
    assert value(s, "backfill_prompt_tokens_bucket", le="+Inf") == 2
    # Without a ledger the Postgres figures still come, and the ledger is marked down.
    assert value(s, "backfill_metrics_source_up", source="ledger") == 0

    again = parse(generate_latest(registry).decode())
    assert value(again, "backfill_output_tokens_count") == 2  # nothing counted twice
    run_worker(repo)
    later = parse(generate_latest(registry).decode())
    assert value(later, "backfill_output_tokens_count") == 3
    assert value(later, "backfill_prompt_tokens_sum") == 48


def test_a_database_that_is_down_leaves_the_scrape_answering(settings: Settings) -> None:
    down = Repository.connect("postgresql://postgres@127.0.0.1:1/nowhere", pool_size=1)
    registry = CollectorRegistry()
    registry.register(BackfillCollector(down, None))
    try:
        s = parse(generate_latest(registry).decode())
    finally:
        down.close()
    assert value(s, "backfill_metrics_source_up", source="postgres") == 0
