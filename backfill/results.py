"""Results as OpenAI's batch output and error files (JSONL), rendered from items on read.

Output and error files are not stored: their rows in ``files`` name the job, and their content
is rendered here from the job's items, page by page, so a 100,000-item result never sits in
memory whole and is never stored twice. The same rendering streams results while a job runs.

Line shape (OpenAI's)::

    {"id": "batch_req_...", "custom_id": "...",
     "response": {"status_code": 200, "request_id": "...", "body": {...}} | null,
     "error": {"code": "...", "message": "..."} | null}

A request refused as an HTTP request (the engine's 4xx, or Backfill's own refusal of what the
engine would refuse, e.g. a prompt over the context) is written as OpenAI writes HTTP errors:
``response: {status_code, request_id, body: {error: {...}}}``, ``error: null``. Requests that
never got an answer (expired, cancelled, retries exhausted) have ``error`` instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from backfill.refusals import InvalidRequest
from backfill.states import ItemState
from backfill.store import ItemPages, ItemRecord

OUTPUT_STATES: tuple[ItemState, ...] = (ItemState.SUCCEEDED,)
ERROR_STATES: tuple[ItemState, ...] = (ItemState.FAILED, ItemState.EXPIRED, ItemState.CANCELLED)
RESULT_STATES: tuple[ItemState, ...] = OUTPUT_STATES + ERROR_STATES

PAGE_SIZE = 1000

_ENDED_WITHOUT_RUNNING: dict[ItemState, tuple[str, str]] = {
    ItemState.EXPIRED: (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
    ItemState.CANCELLED: ("batch_cancelled", "This request was cancelled with its batch."),
}


def parse_result_states(values: Iterable[str] | None) -> list[ItemState]:
    """Finished states named in a query (repeated or comma-separated); all when none."""
    names = [v.strip() for value in values or () for v in value.split(",") if v.strip()]
    if not names:
        return list(RESULT_STATES)
    finished = {s.value: s for s in RESULT_STATES}
    unknown = [n for n in names if n not in finished]
    if unknown:
        raise InvalidRequest(
            f"state {unknown[0]!r} is not a finished state; use one of " + ", ".join(finished),
            param="state",
        )
    return [finished[n] for n in dict.fromkeys(names)]


def http_error_record(
    status: int,
    code: str | None,
    message: str,
    *,
    param: str | None = None,
    error: dict[str, Any] | None = None,
) -> str:
    """What the worker stores for a request refused with an HTTP error: ``error`` is the
    engine's own error object when it sent one (kept as it was), else one is made in OpenAI's
    shape from the rest."""
    body = dict(error) if error else {}
    body.setdefault("message", message)
    body.setdefault("type", "invalid_request_error" if status < 500 else "server_error")
    body.setdefault("param", param)
    body.setdefault("code", code)
    return json.dumps({"code": code, "message": message, "status_code": status, "error": body})


def _http_error(detail: Any) -> tuple[int, dict[str, Any]] | None:
    """(status, error object) of a stored HTTP error record, None for any other error."""
    if not isinstance(detail, dict):
        return None
    status, error = detail.get("status_code"), detail.get("error")
    if type(status) is int and isinstance(error, dict):
        return status, error
    return None


def json_or_text(value: str | None) -> Any:
    """A stored result or error is JSON text from the worker; anything else travels as text."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError:
        return value


def _error_object(item: ItemRecord) -> dict[str, Any]:
    if item.state in _ENDED_WITHOUT_RUNNING:
        code, message = _ENDED_WITHOUT_RUNNING[item.state]
        if item.error and not item.error.lstrip().startswith("{"):
            # The worker said why (e.g. how long the request needed and how long was left).
            message = f"{message} {item.error}"
        return {"code": code, "message": message}
    detail = json_or_text(item.error)
    if isinstance(detail, dict):
        inner = detail.get("error", detail)
        if isinstance(inner, dict) and "message" in inner:
            return {"code": inner.get("code") or "request_failed", "message": str(inner["message"])}
    return {"code": "request_failed", "message": str(detail or "the request failed")}


def result_line(item: ItemRecord) -> str:
    """One finished item as a line of the output file (succeeded) or error file (the rest)."""
    line: dict[str, Any] = {"id": f"batch_req_{item.id}", "custom_id": item.custom_id}
    request_id = f"req_{item.job_id}_{item.line_no}_{item.attempt}"
    refused = _http_error(json_or_text(item.error)) if item.state is ItemState.FAILED else None
    if item.state is ItemState.SUCCEEDED:
        line["response"] = {
            "status_code": 200,
            "request_id": request_id,
            "body": json_or_text(item.result),
        }
        line["error"] = None
    elif refused is not None:
        status, error = refused
        line["response"] = {
            "status_code": status,
            "request_id": request_id,
            "body": {"error": error},
        }
        line["error"] = None
    else:
        line["response"] = None
        line["error"] = _error_object(item)
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"


def iter_result_lines(
    repo: ItemPages, job_id: str, states: Iterable[ItemState], *, page_size: int = PAGE_SIZE
) -> Iterator[str]:
    """The job's items in ``states``, in line order, rendered; pages through Postgres."""
    wanted = tuple(states)
    after = -1
    while True:
        page = repo.items.items(job_id, states=wanted, after_line=after, limit=page_size)
        for item in page:
            yield result_line(item)
        if len(page) < page_size:
            return
        after = page[-1].line_no


def rendered_size(repo: ItemPages, job_id: str, states: Iterable[ItemState]) -> tuple[int, int]:
    """(lines, bytes) the rendering of ``states`` would produce: the File object's ``bytes``."""
    lines = size = 0
    for line in iter_result_lines(repo, job_id, states):
        lines += 1
        size += len(line.encode())
    return lines, size
