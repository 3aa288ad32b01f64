"""What one tenant may keep stored (issue 35): input file bytes and batch items, each capped
per tenant; past a cap uploads and creates are refused naming it (429, not retried), a batch
whose items would pass it fails naming it, nothing refused is stored, and other tenants go on.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from batch_api_support import api_settings, chat_file, make_tenant, serve, submit_file

from backfill.config import Settings
from backfill.store import Repository


def _stored_files(repo: Repository, tenant_id: str) -> int:
    return repo.tenants.stored_input_bytes(tenant_id)


def test_uploads_past_a_tenants_byte_cap_are_refused_and_store_nothing(
    settings: Settings, repo: Repository
) -> None:
    one = chat_file(40)
    acme = make_tenant(repo, "acme")
    other = make_tenant(repo, "other")
    capped = api_settings(settings, max_stored_bytes_per_tenant=len(one) * 2 + len(one) // 2)
    with serve(capped) as server:
        client = server.client(acme.key)
        for _ in range(2):
            client.files.create(file=("in.jsonl", one), purpose="batch")
        # A third would pass the cap mid-stream: refused, and nothing of it kept.
        with pytest.raises(openai.RateLimitError) as refused:
            client.files.create(file=("in.jsonl", one), purpose="batch")
        assert refused.value.code == "storage_cap_reached"
        assert refused.value.response.headers.get("x-should-retry") == "false"
        assert "BACKFILL_MAX_STORED_BYTES_PER_TENANT" in refused.value.message
        assert _stored_files(repo, acme.id) == 2 * len(one)
        assert len(client.files.list().data) == 2
        # Another tenant is not held by acme's cap.
        server.client(other.key).files.create(file=("in.jsonl", one), purpose="batch")
        # Deleting a file makes room again.
        first = client.files.list().data[0]
        client.files.delete(first.id)
        client.files.create(file=("in.jsonl", one), purpose="batch")


def test_batches_past_a_tenants_item_cap_fail_or_are_refused_naming_it(
    settings: Settings, repo: Repository
) -> None:
    acme = make_tenant(repo, "acme")
    capped = api_settings(settings, max_stored_items_per_tenant=150)
    with serve(capped) as server:
        client = server.client(acme.key)
        assert submit_file(client, chat_file(100)).status == "in_progress"
        # 100 stored + 100 more would pass 150: the batch fails naming the cap, none stored.
        failed = submit_file(client, chat_file(100))
        assert failed.status == "failed"
        assert failed.errors is not None
        assert failed.errors.data is not None
        assert failed.errors.data[0].code == "storage_cap_reached"
        assert repo.stats.counted_states(failed.id) == {}
        assert submit_file(client, chat_file(50)).status == "in_progress"
        # At the cap, a create is refused before anything is done.
        upload = client.files.create(file=("in.jsonl", chat_file(1)), purpose="batch")
        with httpx.Client(
            base_url=server.base_url, headers={"Authorization": f"Bearer {acme.key}"}
        ) as h:
            answer = h.post(
                "/v1/batches",
                json={
                    "input_file_id": upload.id,
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
        assert answer.status_code == 429
        assert answer.json()["error"]["code"] == "storage_cap_reached"
        assert "BACKFILL_RETENTION_S" in answer.json()["error"]["message"]
