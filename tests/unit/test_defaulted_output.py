"""A line that gave no output budget gets, at each run, what the class limit leaves its exact
prompt (at most what ingest stored for it), and the request sent says so in the field the
engine obeys, so the reservation covers exactly what the engine may generate
(``backfill.output_budget``, ``backfill.dispatch.checks.fit_output``). A budget the caller
gave is theirs: it is never cut, and over the limit the item fails as before."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from backfill.capacity import round_up_to_block
from backfill.dispatch import CheckedItem, Fail, fit_output, judge
from backfill.output_budget import budget_field, fitted_output, with_output_budget
from backfill.prefill import CHAT, COMPLETIONS, RESPONSES, PromptCount
from backfill.store import ClaimedItem
from tests.unit.dispatch_builders import BLOCK, LIMITS, claimed
from tests.unit.test_dispatch_tokenize import CountingEngine, _dispatcher
from worker.prepare import run_plan

LIMIT = LIMITS.max_sequence_tokens  # 4096
STORED = 2048
"""What ingest stored for the line: the default, its prompt's lower bound leaving more."""


def _item(prompt_chars: int, *, defaulted: bool = True, **fields: Any) -> ClaimedItem:
    body = {"model": "m", "prompt": "x" * prompt_chars, "max_tokens": STORED}
    return claimed(body=json.dumps(body), max_output_tokens=STORED, output_defaulted=defaulted)


def _checked(item: ClaimedItem, prompt: int) -> CheckedItem:
    count = PromptCount.single(prompt)
    return CheckedItem(item, fit_output(item, run_plan(item), count, LIMIT), count, prompt)


def test_the_budget_is_what_the_limit_leaves_at_most_the_cap() -> None:
    assert fitted_output(2048, 4096, 100) == 2048
    assert fitted_output(2048, 4096, 4000) == 96
    assert fitted_output(2048, 4096, 4096) == 0


@pytest.mark.parametrize(
    ("endpoint", "request_body", "field"),
    [
        (CHAT, {"max_tokens": 9}, "max_tokens"),
        (CHAT, {"max_completion_tokens": 9, "max_tokens": 9}, "max_completion_tokens"),
        (COMPLETIONS, {"max_tokens": 9}, "max_tokens"),
        (RESPONSES, {"max_output_tokens": 9}, "max_output_tokens"),
    ],
)
def test_the_budget_goes_in_the_field_the_engine_obeys(
    endpoint: str, request_body: dict[str, Any], field: str
) -> None:
    assert budget_field(endpoint, request_body) == field
    fitted = with_output_budget(endpoint, request_body, 5)
    assert fitted[field] == 5
    assert request_body[field] == 9  # the stored body is not touched


def test_a_defaulted_run_whose_prompt_leaves_less_than_its_budget_sends_what_is_left() -> None:
    checked = _checked(_item(4000), 4000)
    assert judge(checked.item, checked, LIMITS, left_s=600.0) is checked
    assert checked.max_output == LIMIT - 4000
    assert checked.run.request["max_tokens"] == LIMIT - 4000
    assert checked.reservation(BLOCK) == round_up_to_block(LIMIT, BLOCK)


def test_a_defaulted_run_whose_prompt_leaves_more_keeps_its_stored_budget() -> None:
    checked = _checked(_item(100), 100)
    assert checked.max_output == STORED
    assert checked.run.request["max_tokens"] == STORED


def test_a_defaulted_run_whose_prompt_fills_the_limit_fails_naming_the_prompt() -> None:
    checked = _checked(_item(LIMIT), LIMIT)
    verdict = judge(checked.item, checked, LIMITS, left_s=600.0)
    assert isinstance(verdict, Fail)
    error = json.loads(verdict.error)
    assert error["code"] == "context_length_exceeded"
    assert "the prompt (4096 tokens) leaves no room for output" in error["message"]


def test_a_budget_the_caller_gave_is_never_cut_and_fails_over_the_limit() -> None:
    checked = _checked(_item(4000, defaulted=False), 4000)
    assert checked.run.request["max_tokens"] == STORED
    verdict = judge(checked.item, checked, LIMITS, left_s=600.0)
    assert isinstance(verdict, Fail)
    assert "prompt (4000 tokens) + max_tokens (2048)" in json.loads(verdict.error)["message"]


def test_the_dispatcher_sends_a_defaulted_item_what_its_exact_prompt_leaves() -> None:
    # The worker's own path: counted by the engine, fitted, reserved on what it sends.
    dispatcher = _dispatcher(CountingEngine())
    ready, refused = asyncio.run(dispatcher.checker.check([_item(3000), _item(100)]))
    assert not refused
    long, short = ready
    assert long.run.request["max_tokens"] == long.max_output == LIMIT - 3000
    assert short.run.request["max_tokens"] == short.max_output == STORED
    for c in ready:
        assert c.reservation(BLOCK) >= c.count.longest + c.run.request["max_tokens"]


def test_a_resumed_defaulted_item_continues_with_what_the_limit_leaves_its_new_prompt() -> None:
    # Its continuation's prompt holds the 50 tokens generated so far: what is left of the
    # stored budget (1998) is cut to what the limit leaves that prompt, and it continues
    # rather than running again from the start (which could not fit its whole budget).
    item = _item(3900)
    resumed = claimed(
        body=item.body,
        max_output_tokens=STORED,
        output_defaulted=True,
        partial_output="y" * 50,
        partial_tokens=50,
    )
    dispatcher = _dispatcher(CountingEngine())
    (ready,), refused = asyncio.run(dispatcher.checker.check([resumed]))
    assert not refused
    assert ready.run.kept == 50
    assert ready.count.longest == 3950
    assert ready.run.request["max_tokens"] == ready.max_output == LIMIT - 3950
