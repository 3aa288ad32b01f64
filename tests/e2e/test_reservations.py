"""The invariant against the engine's own counts: no admitted request, batch or interactive,
makes the engine hold more KV than its reservation.

Requests built to hold more than a count of their message text shows: a completions line of
several prompts (one sequence each), chat with a tool schema, with documents and with template
arguments rendered by a request chat template, and a resumed item stored with lax numbers.
For each, the engine is asked directly what it prefills for the same body
(``usage.prompt_tokens`` of a one-token run); the lease that covered it must hold that plus
every sequence's output budget. The worker also checks each attempt's final usage against its
lease (``reservation_violations``), which must stay 0.

Lines without an output budget, under a batch limit below the model's context: each gets what
the limit leaves its exact prompt (at most the default), the engine is sent exactly that and
generates it (``ignore_eos``), and the lease covers it; a property test over the budget fields
(``max_tokens``, ``max_completion_tokens``, both, null, none; ``n``; chat and completions)
holds every run to its lease.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import hypothesis
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from sqlalchemy import text

from backfill.capacity import round_up_to_block
from backfill.config import Settings
from backfill.ledger import Ledger
from backfill.prefill import CHAT, COMPLETIONS, RESPONSES
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
        budget = "max_output_tokens" if endpoint == RESPONSES else "max_tokens"
        reply = httpx.post(
            f"{self.engine_url}{endpoint}",
            json={**body, "model": MODEL, budget: 1, "stream": False},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        return _usage(reply.json())[0]

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
    job_id = _run_to_end(stack, url, lines)
    failed = stack.repo.items.items(job_id, states=[ItemState.FAILED, ItemState.EXPIRED])
    assert not failed, [(i.custom_id, i.error) for i in failed]
    return job_id


def _run_to_end(stack: Stack, url: str, lines: list[dict[str, Any]]) -> str:
    """A batch of ``lines``, run until each of its items has ended, however."""
    client = stack.api.client(stack.tenant.key)
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=url, completion_window="1h")  # type: ignore[arg-type]
    assert batch.status == "in_progress", batch
    # No beat runs here to finalize the batch: judge by its items.
    ended = (ItemState.SUCCEEDED, ItemState.FAILED, ItemState.EXPIRED)

    def finished() -> bool:
        counts = stack.repo.stats.counted_states(batch.id)
        return sum(counts.get(s, 0) for s in ended) == len(lines)

    wait(finished, 600, f"every item to end: {stack.repo.stats.counted_states(batch.id)}")
    return batch.id


def _reservations(stack: Stack, job_id: str) -> dict[str, int]:
    """What covered each item in the engine: its lease's own tokens, and the shared prompt
    prefix its lease leaned on (held once on the node by the ledger; issue 36): items whose
    prompts start alike share one once the worker has found the prefix and it is cached."""
    with stack.repo.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT custom_id, reservation_tokens + lease_prefix_tokens FROM items "
                "WHERE job_id = :j AND reservation_tokens IS NOT NULL"
            ),
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
    f = repo.files.create_file(stack.tenant.id, "batch", "in.jsonl", b"-")
    job = repo.jobs.create_job(
        stack.tenant.id, f.id, "/v1/completions", "1h", datetime.now(UTC) + timedelta(hours=1)
    )
    body = {"model": MODEL, "prompt": "the fox", "max_tokens": "24.0", "min_tokens": "3.0"}
    repo.ingest.insert_items(job.id, [NewItem(0, "lax", json.dumps(body), 24)])
    with repo.engine.begin() as conn:
        conn.execute(
            text("UPDATE items SET partial_output = :o, partial_tokens = 4 WHERE job_id = :j"),
            {"j": job.id, "o": json.dumps(" and the")},  # stored as the repository stores it
        )
    repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    wait(
        lambda: repo.stats.counted_states(job.id).get(ItemState.SUCCEEDED, 0) == 1,
        300,
        f"the resumed item to succeed ({repo.stats.counted_states(job.id)})",
    )
    (item,) = repo.items.items(job.id)
    result = json.loads(item.result or "{}")
    assert result["choices"][0]["text"].startswith(" and the")
    assert result["usage"]["completion_tokens"] == 24
    wait(lambda: stack.batch_in_use() == 0, 30, "the lease freed")


# A batch limit under the model's context (512), and a default under the limit: a line without
# max_tokens may generate min(DEFAULT, LIMIT - prompt). An engine sent no budget would generate
# up to 512 - prompt, and one sent the default unfitted would exceed the limit.
LIMIT = 384
DEFAULT = 300
LONG_TEXT = "the deadline of the job " * 40
"""About 200 tokens: what the limit leaves it is less than the default."""


@contextmanager
def _bounded(settings: Settings, engine_url: str, default: int) -> Iterator[Stack]:
    s = node_settings(
        settings,
        max_in_flight_per_node=8,
        work_budget_enabled=False,
        batch_max_sequence_tokens=LIMIT,
        batch_default_max_tokens=default,
    )
    with node_beside(s, NODE, engine_url) as beside:
        repo, ledger, node = beside.repo, beside.ledger, beside.node
        with serve(s) as api:
            yield Stack(s, repo, ledger, engine_url, api, make_tenant(repo, "d"), node)


@pytest.fixture
def bounded(settings: Settings, engine_url: str) -> Iterator[Stack]:
    with _bounded(settings, engine_url, DEFAULT) as stack:
        yield stack


def _line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    # ignore_eos: the engine generates all its budget allows, so its usage is that budget.
    full = {**body, "model": MODEL, "ignore_eos": True, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": full}


@dataclass(frozen=True)
class Ran:
    """One finished item: what the engine reported, and what was reserved for it."""

    prompt_tokens: int
    completion_tokens: int
    reserved: int


def _ran(stack: Stack, job_id: str) -> dict[str, Ran]:
    """The job's succeeded items, by custom_id."""
    reserved = _reservations(stack, job_id)
    ran: dict[str, Ran] = {}
    for item in stack.repo.items.items(job_id, states=[ItemState.SUCCEEDED]):
        prompt, completion = _usage(json.loads(item.result or "{}"))
        ran[item.custom_id] = Ran(prompt, completion, reserved[item.custom_id])
    return ran


def _usage(answer: dict[str, Any]) -> tuple[int, int]:
    """An answer's prompt and output tokens (a Response names them input and output)."""
    usage = answer["usage"]
    if "input_tokens" in usage:
        return int(usage["input_tokens"]), int(usage["output_tokens"])
    return int(usage["prompt_tokens"]), int(usage["completion_tokens"])


def _errors(stack: Stack, job_id: str) -> dict[str, str]:
    """The job's failed and expired items' errors, by custom_id."""
    ended = stack.repo.items.items(job_id, states=[ItemState.FAILED, ItemState.EXPIRED])
    return {i.custom_id: i.error or "" for i in ended}


def test_a_line_without_max_tokens_gets_what_the_limit_leaves_its_prompt(bounded: Stack) -> None:
    # Before, the default was written into the line and the long ones failed at the worker
    # (prompt + 300 > 384, context_length_exceeded): a request OpenAI or vLLM would run.
    chat = [
        _line("chat long", CHAT, {"messages": [{"role": "user", "content": LONG_TEXT}]}),
        _line("chat short", CHAT, {"messages": MESSAGES}),
    ]
    completions = [_line("completions long", COMPLETIONS, {"prompt": LONG_TEXT})]
    responses = [_line("responses long", RESPONSES, {"input": LONG_TEXT})]
    ran = {
        **_ran(bounded, _run_batch(bounded, CHAT, chat)),
        **_ran(bounded, _run_batch(bounded, COMPLETIONS, completions)),
        **_ran(bounded, _run_batch(bounded, RESPONSES, responses)),
    }
    for line in chat + completions + responses:
        name = line["custom_id"]
        prompt = bounded.engine_prompt_tokens(line["url"], line["body"])
        got = ran[name]
        assert got.prompt_tokens == prompt, name
        budget = min(DEFAULT, LIMIT - prompt)
        if name.endswith("long"):
            assert budget < DEFAULT, (
                f"{name}: its prompt ({prompt}) must leave less than the default"
            )
        # The engine generated exactly the fitted budget: it was sent that, in the field it
        # obeys (with no budget it would have gone on to the model's 512).
        assert got.completion_tokens == budget, (name, got, prompt)
        assert got.reserved == round_up_to_block(prompt + budget, BLOCK), (name, got)
        assert got.prompt_tokens + got.completion_tokens <= got.reserved
    assert bounded.reservation_violations() == 0


SMALL_DEFAULT = 40
"""The property's default: every sequence generates 40 tokens at most, so it runs fast."""
PROMPT_TEXT = {"short": "summarise the text", "long": "the deadline of the job " * 70}
"""The long one is about 350 tokens (chat a few more): the limit leaves it less than 40."""


@dataclass(frozen=True)
class BudgetLine:
    """A generated line: its endpoint, its prompt ("both": a completions list of the short
    and the long one), and how it gives its output budget."""

    url: str
    shape: str
    kind: str
    """"none" (no field), "null", "max_tokens", "max_completion_tokens" or "both"."""
    budget: int
    n: bool
    """Whether the body says ``n: 1``."""

    @property
    def defaulted(self) -> bool:
        return self.kind in ("none", "null")

    @property
    def sequences(self) -> int:
        return 2 if self.shape == "both" else 1

    @property
    def longest(self) -> str:
        return "long" if self.shape == "both" else self.shape

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if self.url == CHAT:
            body["messages"] = [{"role": "user", "content": PROMPT_TEXT[self.shape]}]
        elif self.shape == "both":
            body["prompt"] = [PROMPT_TEXT["short"], PROMPT_TEXT["long"]]
        else:
            body["prompt"] = PROMPT_TEXT[self.shape]
        if self.kind == "null":
            body["max_tokens"] = None
        elif self.kind == "both":
            # vLLM's chat request obeys max_completion_tokens; Backfill holds the larger.
            body["max_completion_tokens"] = self.budget
            body["max_tokens"] = self.budget + 5
        elif self.kind != "none":
            body[self.kind] = self.budget
        if self.n:
            body["n"] = 1
        return body


@st.composite
def _budget_lines(draw: st.DrawFn) -> list[BudgetLine]:
    lines = []
    for _ in range(draw(st.integers(2, 5))):
        url = draw(st.sampled_from([CHAT, COMPLETIONS]))
        chat = url == CHAT
        shapes = ["short", "long"] + ([] if chat else ["both"])
        kinds = ["none", "null", "max_tokens", "max_completion_tokens"] + (["both"] if chat else [])
        lines.append(
            BudgetLine(
                url,
                draw(st.sampled_from(shapes)),
                draw(st.sampled_from(kinds)),
                draw(st.integers(1, SMALL_DEFAULT)),
                draw(st.booleans()),
            )
        )
    return lines


def test_what_the_engine_generates_never_exceeds_what_was_reserved(
    settings: Settings, engine_url: str
) -> None:
    # Every way a line may give its output budget or leave it out: without one it never fails
    # and gets what the limit leaves its longest prompt, at most the default; with one it gets
    # exactly that or, over the limit, fails; and what the engine holds fits the lease.
    with _bounded(settings, engine_url, SMALL_DEFAULT) as stack:
        prompt_tokens = {
            (url, shape): stack.engine_prompt_tokens(
                url, BudgetLine(url, shape, "none", 1, False).body()
            )
            for url in (CHAT, COMPLETIONS)
            for shape in ("short", "long")
        }
        assert all(
            SMALL_DEFAULT > LIMIT - prompt_tokens[u, "long"] > 0 for u in (CHAT, COMPLETIONS)
        )

        @hypothesis.settings(
            max_examples=8,
            database=None,
            derandomize=True,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(lines=_budget_lines())
        def check(lines: list[BudgetLine]) -> None:
            ran: dict[str, Ran] = {}
            errors: dict[str, str] = {}
            for url in (CHAT, COMPLETIONS):
                batch = [
                    _line(str(i), url, line.body())
                    for i, line in enumerate(lines)
                    if line.url == url
                ]
                if batch:
                    job_id = _run_to_end(stack, url, batch)
                    ran.update(_ran(stack, job_id))
                    errors.update(_errors(stack, job_id))
            assert len(ran) + len(errors) == len(lines)
            for i, line in enumerate(lines):
                longest = prompt_tokens[line.url, line.longest]
                held = line.budget + 5 if line.kind == "both" else line.budget
                if not line.defaulted and longest + held > LIMIT:
                    assert "context_length_exceeded" in errors.get(str(i), ""), (line, errors)
                    continue
                assert str(i) in ran, (line, errors.get(str(i)))
                got = ran[str(i)]
                sent = min(SMALL_DEFAULT, LIMIT - longest) if line.defaulted else line.budget
                assert got.completion_tokens == line.sequences * sent, (line, got, longest)
                assert got.prompt_tokens + got.completion_tokens <= got.reserved, (line, got)
            assert stack.reservation_violations() == 0

        check()
