"""What becomes of a counted item before any engine work (``backfill.dispatch.checks``) and of
a failed attempt (``backfill.dispatch.outcomes``): refusals fail at once, a missing engine
gives the item back untouched, the item's own trouble backs off until its attempts run out,
and what cannot finish before its deadline expires unstarted."""

from __future__ import annotations

import json

import pytest

from backfill.dispatch import (
    EngineAbsent,
    Expire,
    Fail,
    FailureKind,
    GiveBack,
    backoff_s,
    judge,
    over_limit,
    retry_or_fail,
)
from backfill.engine.protocol import EngineRejected, EngineUnavailable
from backfill.prefill import PromptCount
from backfill.refusals import InvalidRequest
from backfill.states import ItemState
from tests.unit.dispatch_builders import BLOCK, LIMITS, checked, claimed


def _error(verdict: object) -> dict[str, object]:
    assert isinstance(verdict, Fail)
    decoded = json.loads(verdict.error)
    assert isinstance(decoded, dict)
    return decoded


def test_an_item_that_fits_its_limit_and_deadline_starts_as_counted() -> None:
    item = checked(prompt=100)
    assert judge(item.item, item, LIMITS, left_s=60.0) is item


def test_over_the_class_limit_fails_as_context_length_exceeded() -> None:
    item = checked(prompt=4096 - 63)
    error = _error(judge(item.item, item, LIMITS, left_s=60.0))
    assert error["code"] == "context_length_exceeded"
    assert error["status_code"] == 400
    assert "4033 tokens) + max_tokens (64) = 4097 exceeds the batch limit of 4096" in str(
        error["message"]
    )


def test_the_limit_is_per_sequence_on_the_longest_prompt() -> None:
    assert over_limit(PromptCount(4000, 8000, 2), 96, 4096) is None
    assert over_limit(PromptCount(4001, 8001, 2), 96, 4096) is not None


def test_an_item_that_cannot_finish_in_time_expires_with_the_estimate() -> None:
    # 100 prompt tokens at 1000/s and 64 output tokens at 20/s: about 3.3 s.
    item = checked(prompt=100)
    verdict = judge(item.item, item, LIMITS, left_s=3.0)
    assert verdict == Expire("needs about 3.3 s at 20.0 tokens/s; 3.0 s left before the deadline")
    assert judge(item.item, item, LIMITS, left_s=3.5) is item


def test_a_resumed_item_needs_only_its_remaining_output() -> None:
    item = checked(prompt=100, kept=60)
    assert judge(item.item, item, LIMITS, left_s=0.5) is item


def test_an_engine_refusal_fails_as_invalid_request_keeping_its_error_object() -> None:
    refusal = EngineRejected(400, "bad prompt", {"message": "bad prompt", "code": "x"})
    error = _error(judge(claimed(), refusal, LIMITS, left_s=60.0))
    assert error["code"] == "invalid_request"
    assert error["error"] == {
        "message": "bad prompt",
        "code": "x",
        "type": "invalid_request_error",
        "param": None,
    }


def test_an_invalid_request_fails_with_its_own_code_and_param() -> None:
    refused = InvalidRequest("n must be a positive integer", param="n")
    error = _error(judge(claimed(), refused, LIMITS, left_s=60.0))
    assert error["status_code"] == 400
    assert error["code"] == refused.code
    assert error["error"]["param"] == "n"  # type: ignore[index]


def test_an_engine_that_cannot_count_gives_the_item_back_untouched() -> None:
    verdict = judge(claimed(), EngineUnavailable("connection refused"), LIMITS, left_s=60.0)
    assert verdict == EngineAbsent(GiveBack("tokenize failed: connection refused"))


def test_a_prompt_that_cannot_be_counted_backs_off_then_fails_at_the_cap() -> None:
    cause = ValueError("not JSON")
    first = judge(claimed(attempt=1), cause, LIMITS, left_s=60.0)
    assert first == GiveBack(
        "the prompt could not be counted: ValueError('not JSON')", ItemState.QUEUED, 0.25
    )
    error = _error(judge(claimed(attempt=3), cause, LIMITS, left_s=60.0))
    assert error == {
        "code": "retries_exhausted",
        "message": "3 attempts failed; last error: the prompt could not be counted: "
        "ValueError('not JSON')",
    }


def test_an_engine_error_is_retried_at_once_and_fails_at_the_cap() -> None:
    cause = EngineUnavailable("reset")
    assert retry_or_fail(2, 3, FailureKind.ENGINE, cause) == GiveBack("engine error: reset")
    assert _error(retry_or_fail(3, 3, FailureKind.ENGINE, cause)) == {
        "code": "retries_exhausted",
        "message": "the engine failed 3 attempts; last error: reset",
    }


def test_a_worker_error_backs_off_and_fails_at_the_cap() -> None:
    cause = RuntimeError("boom")
    assert retry_or_fail(2, 3, FailureKind.WORKER, cause) == GiveBack(
        "worker error: RuntimeError('boom')", ItemState.QUEUED, 0.5
    )
    assert _error(retry_or_fail(4, 3, FailureKind.WORKER, cause))["message"] == (
        "4 attempts failed; last error: RuntimeError('boom')"
    )


@pytest.mark.parametrize(("attempt", "wait"), [(0, 0.25), (1, 0.25), (2, 0.5), (5, 4.0), (9, 5.0)])
def test_backoff_doubles_per_attempt_up_to_five_seconds(attempt: int, wait: float) -> None:
    assert backoff_s(attempt) == wait


def test_a_checked_item_reserves_every_sequence_its_prompt_and_remaining_output() -> None:
    item = checked(prompt=100, sequences=2)
    assert item.max_output == 64
    assert item.reservation(BLOCK) == 2 * 176  # round_up(100 + 64, 16) per sequence
    resumed = checked(prompt=130, kept=64)
    assert resumed.max_output == 1  # nothing left: one token, never zero
