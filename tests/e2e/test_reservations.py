"""The invariant against the engine's own counts: no admitted request, batch or interactive,
makes the engine hold more KV than its reservation.

Requests built to hold more than a count of their message text shows: a completions line of
several prompts (one sequence each), chat with a tool schema, with documents and with template
arguments rendered by a request chat template, and a resumed item stored with lax numbers.
For each, the engine is asked directly what it prefills for the same body
(``usage.prompt_tokens`` of a one-token run); the lease that covered it must hold that plus
every sequence's output budget. The worker also checks each attempt's final usage against its
lease (``reservation_violations``), which must stay 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import text

from backfill.capacity import round_up_to_block
from backfill.config import Settings
from backfill.ledger import Ledger
from backfill.states import ItemState, JobState
from backfill.store import NewItem, Repository
from tests.e2e import helpers
from tests.e2e.helpers import node_beside, node_settings, wait
from tests.integration.batch_api_support import (
    LiveServer,
    Tenant,
    jsonl,
    make_tenant,
    serve,
)
from worker.node import NodeThread

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BLOCKS = 48
BLOCK = 128
MODEL = "tiny"
NODE = "r1"

# Renders what the tiny model's own template leaves out: tools, documents, an argument.
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% for d in documents or [] %}{{ d['text'] }}{% endfor %}"
    "{{ extra or '' }}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "the batch queue token cache block " * 20,
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "summarise the text"}]

CHAT_BODIES: dict[str, dict[str, Any]] = {
    "tools": {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "none",
        "chat_template": TEMPLATE,
    },
    "documents": {
        "messages": MESSAGES,
        "documents": [{"title": "a", "text": "the lease " * 60}],
        "chat_template": TEMPLATE,
    },
    "template arguments": {
        "messages": MESSAGES,
        "chat_template_kwargs": {"extra": "slack reserve " * 60},
        "chat_template": TEMPLATE,
    },
    "no generation prompt": {"messages": MESSAGES, "add_generation_prompt": False},
}
PROMPTS = ["the fox and the " * 8, "a queue", "the deadline of the job " * 4]


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    yield from helpers.engine_url(
        MODEL,
        num_gpu_blocks_override=BLOCKS,
        max_model_len=512,
        kv_cache_gib=1,
        # Request chat templates render what the model's own template leaves out.
        extra_args=["--trust-request-chat-template"],
    )


@dataclass
class Stack:
    settings: Settings
    repo: Repository
    ledger: Ledger
    engine_url: str
    api: LiveServer
    tenant: Tenant
    node: NodeThread

    def engine_prompt_tokens(self, endpoint: str, body: dict[str, Any]) -> int:
        """What the engine itself prefills for ``body``: its usage of a one-token run."""
        reply = httpx.post(
            f"{self.engine_url}{endpoint}",
            json={**body, "model": MODEL, "max_tokens": 1, "stream": False},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["prompt_tokens"])

    def batch_in_use(self) -> int:
        snap = self.ledger.snapshot(NODE)
        return 0 if snap is None else snap.batch_in_use

    def reservation_violations(self) -> int:
        return sum(d.stats.reservation_violations for d in self.node.dispatchers)


@pytest.fixture
def stack(settings: Settings, engine_url: str) -> Iterator[Stack]:
    s = node_settings(
        settings,
        max_in_flight_per_node=8,
        gateway_max_wait_s=10.0,
        work_budget_enabled=False,
    )
    with node_beside(s, NODE, engine_url) as beside:
        repo, ledger, node = beside.repo, beside.ledger, beside.node
        with serve(s) as api:
            yield Stack(s, repo, ledger, engine_url, api, make_tenant(repo, "r"), node)


def _batch_line(custom_id: str, url: str, body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    full = {**body, "model": MODEL, "max_tokens": max_tokens, "ignore_eos": True}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": full}


def _run_batch(stack: Stack, url: str, lines: list[dict[str, Any]]) -> str:
    client = stack.api.client(stack.tenant.key)
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=url, completion_window="1h")  # type: ignore[arg-type]
    assert batch.status == "in_progress", batch
    # No beat runs here to finalize the batch: judge by its items.
    ended = (ItemState.SUCCEEDED, ItemState.FAILED, ItemState.EXPIRED)

    def finished() -> bool:
        counts = stack.repo.counted_states(batch.id)
        return sum(counts.get(s, 0) for s in ended) == len(lines)

    wait(finished, 600, f"every item to end: {stack.repo.counted_states(batch.id)}")
    failed = stack.repo.items(batch.id, states=[ItemState.FAILED, ItemState.EXPIRED])
    assert not failed, [(i.custom_id, i.error) for i in failed]
    return batch.id


def _reservations(stack: Stack, job_id: str) -> dict[str, int]:
    with stack.repo.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT custom_id, reservation_tokens FROM items WHERE job_id = :j"),
            {"j": job_id},
        ).all()
    return {r[0]: int(r[1]) for r in rows}


def test_batch_reservations_cover_what_the_engine_prefills_and_generates(stack: Stack) -> None:
    max_tokens = 40
    chat = [
        _batch_line(name, "/v1/chat/completions", body, max_tokens)
        for name, body in CHAT_BODIES.items()
    ]
    chat_job = _run_batch(stack, "/v1/chat/completions", chat)
    completions = [
        _batch_line("prompts", "/v1/completions", {"prompt": PROMPTS}, max_tokens),
        _batch_line("token ids", "/v1/completions", {"prompt": [[1, 2, 3], [4] * 30]}, max_tokens),
    ]
    completions_job = _run_batch(stack, "/v1/completions", completions)

    reserved = {**_reservations(stack, chat_job), **_reservations(stack, completions_job)}
    sequences = {"prompts": len(PROMPTS), "token ids": 2}
    shortfalls: dict[str, tuple[int, int]] = {}
    for line in chat + completions:
        name = line["custom_id"]
        n = sequences.get(name, 1)
        # The engine's usage sums the prompts of a list; each sequence holds its own prompt
        # and up to max_tokens of output (one sequence: in whole blocks).
        held = stack.engine_prompt_tokens(line["url"], line["body"]) + n * max_tokens
        need = round_up_to_block(held, BLOCK) if n == 1 else held
        if reserved[name] < need:
            shortfalls[name] = (reserved[name], need)
    assert not shortfalls, f"reserved less than the engine holds (reserved, held): {shortfalls}"
    assert stack.reservation_violations() == 0


def _admitted_reservations() -> tuple[float, float]:
    """The gateway's count and sum of admitted interactive reservations (its histogram, in
    this process: the API serves from a thread here)."""
    name = "backfill_gateway_reserved_tokens"
    count = REGISTRY.get_sample_value(f"{name}_count") or 0.0
    total = REGISTRY.get_sample_value(f"{name}_sum") or 0.0
    return count, total


def test_interactive_reservations_cover_what_the_engine_prefills(stack: Stack) -> None:
    # Read from the gateway's own record of each admission, not by sampling the ledger while
    # the request streams: a loaded machine may read the whole stream after its lease ended.
    max_tokens = 40
    shortfalls: dict[str, tuple[int, int]] = {}
    for name, body in CHAT_BODIES.items():
        held = stack.engine_prompt_tokens("/v1/chat/completions", body) + max_tokens
        count_before, sum_before = _admitted_reservations()
        with httpx.stream(
            "POST",
            f"{stack.api.base_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {stack.tenant.key}"},
            json={
                **body,
                "model": MODEL,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            },
            timeout=120,
        ) as reply:
            assert reply.status_code == 200, reply.read()
            for _ in reply.iter_lines():
                pass
        count_after, sum_after = _admitted_reservations()
        assert count_after - count_before == 1, (
            f"{name}: one admission, not {count_after - count_before}"
        )
        reserved = int(sum_after - sum_before)
        if reserved < round_up_to_block(held, BLOCK):
            shortfalls[name] = (reserved, held)
    assert not shortfalls, f"reserved less than the engine holds (reserved, held): {shortfalls}"


def test_a_resumed_item_stored_with_lax_numbers_finishes_and_frees_its_lease(
    stack: Stack,
) -> None:
    # As a version that did not normalise numbers stored it, after a preemption: resuming it
    # crashed the worker's task (int("3.0")) and left it running, its lease held, for good.
    repo = stack.repo
    f = repo.create_file(stack.tenant.id, "batch", "in.jsonl", b"-")
    job = repo.create_job(
        stack.tenant.id, f.id, "/v1/completions", "1h", datetime.now(UTC) + timedelta(hours=1)
    )
    body = {"model": MODEL, "prompt": "the fox", "max_tokens": "24.0", "min_tokens": "3.0"}
    repo.insert_items(job.id, [NewItem(0, "lax", json.dumps(body), 24)])
    with repo.engine.begin() as conn:
        conn.execute(
            text("UPDATE items SET partial_output = :o, partial_tokens = 4 WHERE job_id = :j"),
            {"j": job.id, "o": json.dumps(" and the")},  # stored as the repository stores it
        )
    repo.move_job(job.id, JobState.IN_PROGRESS)
    wait(
        lambda: repo.counted_states(job.id).get(ItemState.SUCCEEDED, 0) == 1,
        300,
        f"the resumed item to succeed ({repo.counted_states(job.id)})",
    )
    (item,) = repo.items(job.id)
    result = json.loads(item.result or "{}")
    assert result["choices"][0]["text"].startswith(" and the")
    assert result["usage"]["completion_tokens"] == 24
    wait(lambda: stack.batch_in_use() == 0, 30, "the lease freed")
