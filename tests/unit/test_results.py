"""Result lines as OpenAI writes them (pure: items in, JSONL lines out)."""

from __future__ import annotations

import json
from typing import Any

from backfill.results import http_error_record, result_line
from backfill.states import ItemState
from backfill.store import ItemRecord


def item(state: ItemState, *, result: str | None = None, error: str | None = None) -> ItemRecord:
    return ItemRecord(
        id=7,
        job_id="batch_x",
        line_no=3,
        custom_id="req-3",
        state=state,
        attempt=1,
        result=result,
        error=error,
        output_tokens=None,
        preemptions=0,
    )


def line(record: ItemRecord) -> dict[str, Any]:
    rendered: dict[str, Any] = json.loads(result_line(record))
    return rendered


def test_an_engine_refusal_is_written_as_an_http_error_with_the_engines_own_error() -> None:
    engine_error = {
        "message": "logprobs too big",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    stored = http_error_record(400, "engine_rejected", "logprobs too big", error=engine_error)
    rendered = line(item(ItemState.FAILED, error=stored))
    assert rendered["error"] is None
    assert rendered["response"] == {
        "status_code": 400,
        "request_id": "req_batch_x_3_1",
        "body": {"error": engine_error},
    }


def test_backfills_own_refusal_gets_an_openai_error_object() -> None:
    stored = http_error_record(400, "context_length_exceeded", "600 tokens; the limit is 512")
    rendered = line(item(ItemState.FAILED, error=stored))
    assert rendered["error"] is None
    assert rendered["response"]["status_code"] == 400
    assert rendered["response"]["body"]["error"] == {
        "message": "600 tokens; the limit is 512",
        "type": "invalid_request_error",
        "param": None,
        "code": "context_length_exceeded",
    }


def test_a_request_that_never_got_an_answer_has_an_error_and_no_response() -> None:
    stored = json.dumps({"code": "retries_exhausted", "message": "3 attempts failed"})
    rendered = line(item(ItemState.FAILED, error=stored))
    assert rendered["response"] is None
    assert rendered["error"] == {"code": "retries_exhausted", "message": "3 attempts failed"}
    expired = line(item(ItemState.EXPIRED, error="needs 40 s; 5 s left"))
    assert expired["response"] is None
    assert expired["error"]["code"] == "batch_expired"


def test_a_success_is_a_200_response() -> None:
    rendered = line(item(ItemState.SUCCEEDED, result='{"id": "chatcmpl-1"}'))
    assert rendered["error"] is None
    assert rendered["response"]["status_code"] == 200
    assert rendered["response"]["body"] == {"id": "chatcmpl-1"}
