"""One request line of a batch input file: what checking it works with, and the rules every
endpoint shares (``backfill.batch_checkers`` holds a checker per endpoint over them).

The envelope (JSON, ``custom_id``, method, url, body, model) is checked alike for every
endpoint; the field rules (the prompt field, the engine's types, the output budget, what a
batch cannot ask for, the class limit's lower bound) are shared by the endpoints that use them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic_core

from backfill.config import Settings
from backfill.content_parts import MEDIA_REFUSED, MediaPolicy, tenant_media_policy
from backfill.output_budget import fitted_output
from backfill.prefill import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, prefill_plan
from backfill.refusals import InvalidRequest
from backfill.request_fields import INTEGER_FIELDS, normalise_fields
from backfill.store import NewItem
from backfill.store.bodies import body_span

PROMPT_FIELD: dict[str, str] = {
    CHAT: "messages",
    COMPLETIONS: "prompt",
    EMBEDDINGS: "input",
    RESPONSES: "input",
}
"""Endpoints a batch may target, and the body field that carries each one's prompt."""

MAX_CUSTOM_ID_CHARS = 512

_INTEGER_FIELDS = (*INTEGER_FIELDS, "logprobs")
"""Fields ``normalise_fields`` may rewrite (an integral float to an integer)."""

CHARS_PER_TOKEN_ESTIMATE = 4
"""For forecasts only (ETA, quota, deadline), never for limits: English text averages about
four characters per token with the usual vocabularies."""


@dataclass(frozen=True, slots=True)
class InputLimits:
    max_file_bytes: int
    max_line_bytes: int
    max_lines: int
    max_sequence_tokens: int
    max_bytes_per_token: int
    max_prompts_per_line: int = 64
    default_max_tokens: int = 2048
    """The most a line without ``max_tokens`` (``max_output_tokens`` for ``/v1/responses``)
    may generate: it gets what the limit leaves its prompt, at most this
    (``backfill.output_budget``)."""
    max_embedding_inputs: int = 50_000
    """OpenAI's limit on the inputs of one ``/v1/embeddings`` batch, all its lines together."""
    media: MediaPolicy = MEDIA_REFUSED
    """The media parts a chat line may carry (``backfill.content_parts``): none unless the
    deployment opts in for the batch's tenant."""

    @classmethod
    def from_settings(
        cls, settings: Settings, tenant: tuple[str, str] | None = None
    ) -> InputLimits:
        """The limits of ``settings`` for a batch of ``tenant`` (its id and name; None: the
        limits every tenant's lines share, media refused)."""
        return cls(
            max_file_bytes=settings.max_file_bytes,
            max_line_bytes=settings.max_line_bytes,
            max_lines=settings.max_lines_per_batch,
            max_sequence_tokens=settings.batch_max_sequence_tokens,
            max_bytes_per_token=settings.max_bytes_per_token,
            max_prompts_per_line=settings.batch_max_prompts_per_line,
            default_max_tokens=settings.batch_default_max_tokens,
            media=MEDIA_REFUSED if tenant is None else tenant_media_policy(settings, tenant),
        )


@dataclass(frozen=True, slots=True)
class LineError:
    """One problem of an input file, as an entry of OpenAI's ``errors.data``."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


LineSpot = tuple[int, int, int]
"""Where a line of a stored file lies: (piece, first byte in it, length)."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(raw: bytes) -> Any:
    # pydantic-core's parser first: three times as fast as json's on a 2 KB request, and it
    # reads what it accepts as json does (the last of duplicate keys, big integers, floats
    # exactly). What it refuses (NaN, lone surrogates, deep nesting, a byte-order mark) the
    # reference parser judges, so acceptance and the words of a refusal stay json's.
    try:
        return pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError:
        pass
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        # Nesting deeper than the parser's recursion limit: refused as a line, not a crash.
        raise ValueError("JSON nested too deeply") from None


def dumps(body: dict[str, Any]) -> str:
    try:
        return pydantic_core.to_json(body).decode()
    except (ValueError, TypeError):
        # Integers beyond 64 bits: rare enough to take the slow, exact path.
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def is_positive_int(value: Any) -> bool:
    return type(value) is int and value > 0


@dataclass(frozen=True, slots=True)
class PromptChars:
    """The characters of a line's prompts: the longest bounds the class limit check (each
    prompt is a sequence of its own), all of them together feed the forecasts."""

    longest: int
    total: int
    prompts: int = 1


@dataclass(slots=True)
class Tally:
    """Running totals of the valid lines seen so far."""

    lines: int = 0
    max_output_tokens: int = 0
    prompt_chars: int = 0
    model: str | None = None
    embedding_inputs: int = 0

    @property
    def estimated_prompt_tokens(self) -> int:
        return math.ceil(self.prompt_chars / CHARS_PER_TOKEN_ESTIMATE)


@dataclass(slots=True)
class RequestLine:
    """A request line whose envelope checked out, for its endpoint's checker: the body is
    rewritten in place where the stored body differs from the line's."""

    number: int
    raw: bytes
    spot: LineSpot | None
    custom_id: str
    body: dict[str, Any]

    def error(self, code: str, message: str, param: str | None) -> LineError:
        return LineError(code, message, self.number, param)


# The envelope: rules every endpoint shares.


def request_line(
    raw: bytes,
    spot: LineSpot | None,
    number: int,
    endpoint: str,
    limits: InputLimits,
    seen: set[str],
    tally: Tally,
) -> RequestLine | LineError:
    """A line's envelope (JSON, ``custom_id``, method, url, body, model), or its first fault;
    a valid ``custom_id`` joins ``seen`` and the first model becomes the batch's."""
    request = _request_of(raw, number, limits)
    if isinstance(request, LineError):
        return request
    custom_id = _custom_id(request, number, seen)
    if isinstance(custom_id, LineError):
        return custom_id
    if request.get("method") != "POST":
        return LineError("invalid_method", "method must be 'POST'", number, "method")
    if request.get("url") != endpoint:
        return LineError(
            "mismatched_endpoint",
            f"url {request.get('url')!r} does not match the batch's endpoint {endpoint!r}",
            number,
            "url",
        )
    body = request.get("body")
    if type(body) is not dict:
        return LineError("invalid_body", "body must be a JSON object", number, "body")
    line = RequestLine(number, raw, spot, custom_id, body)
    return _model_error(line, tally) or line


def _request_of(raw: bytes, number: int, limits: InputLimits) -> dict[str, Any] | LineError:
    if len(raw) > limits.max_line_bytes:
        return LineError(
            "line_too_long",
            f"line is {len(raw)} bytes; the limit is {limits.max_line_bytes}",
            number,
        )
    try:
        request = loads(raw)
    except ValueError as exc:
        return LineError("invalid_json_line", f"line is not valid JSON: {exc}", number)
    if type(request) is not dict:
        return LineError("invalid_json_line", "line must be a JSON object", number)
    return request


def _custom_id(request: dict[str, Any], number: int, seen: set[str]) -> str | LineError:
    custom_id = request.get("custom_id")
    if type(custom_id) is not str or not custom_id:
        return LineError(
            "missing_custom_id", "custom_id must be a non-empty string", number, "custom_id"
        )
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return LineError(
            "invalid_custom_id",
            f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters",
            number,
            "custom_id",
        )
    if "\x00" in custom_id:
        # Postgres text cannot hold NUL; refused here, before anything is stored.
        return LineError(
            "invalid_custom_id", "custom_id must not contain NUL (\\u0000)", number, "custom_id"
        )
    if custom_id in seen:
        return LineError(
            "duplicate_custom_id",
            f"custom_id {custom_id!r} appears more than once in the file",
            number,
            "custom_id",
        )
    seen.add(custom_id)
    return custom_id


def _model_error(line: RequestLine, tally: Tally) -> LineError | None:
    """Every line names the same model: a batch runs one."""
    line_model = line.body.get("model")
    if type(line_model) is not str or not line_model:
        return line.error("missing_model", "body.model must be a non-empty string", "body.model")
    if tally.model is None:
        tally.model = line_model
    elif line_model != tally.model:
        return line.error(
            "mismatched_model",
            f"body.model {line_model!r} differs from {tally.model!r}: a batch runs one model",
            "body.model",
        )
    return None


# The field rules the endpoints' checkers share.


def prompt_of(
    line: RequestLine,
    endpoint: str,
    prompt_chars_of: Callable[[Any], PromptChars | str],
    limits: InputLimits,
) -> PromptChars | LineError:
    """The characters of the line's prompt field, or why it is missing, invalid or holds more
    prompts than a line may."""
    prompt_field = PROMPT_FIELD[endpoint]
    param = f"body.{prompt_field}"
    if prompt_field not in line.body:
        return line.error("missing_prompt", f"{param} is required for {endpoint}", param)
    chars = prompt_chars_of(line.body[prompt_field])
    if isinstance(chars, str):
        return line.error(f"invalid_{prompt_field}", chars, param)
    if chars.prompts > limits.max_prompts_per_line:
        return line.error(
            "too_many_prompts",
            f"{param} holds {chars.prompts} prompts; a line may hold at most "
            f"{limits.max_prompts_per_line} (each runs as a sequence of its own: put "
            "the rest on lines of their own)",
            param,
        )
    return chars


def normalised(line: RequestLine, *, chat: bool) -> bool | LineError:
    """The body's fields in the engine's types (an integral float an integer) and a null
    budget dropped (null means "not given", as at OpenAI); whether that rewrote the body."""
    body = line.body
    rewritten = any(type(body.get(key)) is float for key in _INTEGER_FIELDS)
    malformed = normalise_fields(body, chat=chat)
    if malformed is not None:
        param, message = malformed
        budget = param in ("max_tokens", "max_completion_tokens")
        code = "invalid_max_tokens" if budget else "invalid_parameter"
        return line.error(code, message, f"body.{param}")
    for budget_field in ("max_completion_tokens", "max_tokens"):
        if budget_field in body and body[budget_field] is None:
            del body[budget_field]
            rewritten = True
    return rewritten


@dataclass(slots=True)
class OutputBudget:
    """A generating line's output budget: given, or the default (``defaulted``); whether the
    stored body differs from the line's (then the item keeps a copy)."""

    max_tokens: int
    defaulted: bool
    rewritten: bool


def given_budget(
    line: RequestLine, limits: InputLimits, rewritten: bool
) -> OutputBudget | LineError:
    # Optional, as at OpenAI: a line without a budget gets what the limit leaves its
    # prompt, at most the default (fitted in :func:`_fitted`, and to the exact prompt at
    # each run).
    body = line.body
    defaulted = "max_completion_tokens" not in body and "max_tokens" not in body
    max_tokens: Any = (
        limits.default_max_tokens
        if defaulted
        else body.get("max_completion_tokens", body.get("max_tokens"))
    )
    if not is_positive_int(max_tokens) or (
        "max_tokens" in body and not is_positive_int(body["max_tokens"])
    ):
        return line.error(
            "invalid_max_tokens", "max_tokens must be a positive integer", "body.max_tokens"
        )
    if "max_tokens" in body:
        max_tokens = max(max_tokens, body["max_tokens"])
    return OutputBudget(max_tokens, defaulted, rewritten)


def _batch_only_error(line: RequestLine, endpoint: str) -> LineError | None:
    """What a batch line cannot ask for (a stream, more than one choice), and a prompt whose
    prefill cannot be counted."""
    body = line.body
    if body.get("stream"):
        return line.error(
            "unsupported_parameter", "stream is not supported in batches", "body.stream"
        )
    if body.get("n") not in (1, None) or body.get("best_of") not in (1, None):
        return line.error("unsupported_parameter", "n and best_of must be 1 in batches", "body.n")
    try:
        prefill_plan(endpoint, body)
    except InvalidRequest as exc:
        return line.error(exc.code, exc.message, f"body.{exc.param or PROMPT_FIELD[endpoint]}")
    return None


def _fitted(
    line: RequestLine,
    budget: OutputBudget,
    chars: PromptChars,
    limits: InputLimits,
    prompt_param: str,
) -> LineError | None:
    """The class limit's lower bound: a given budget must fit beside the prompt, a default
    is cut to what the prompt leaves (and written into the body)."""
    limit = limits.max_sequence_tokens
    least_prompt_tokens = math.ceil(chars.longest / limits.max_bytes_per_token)
    if budget.defaulted:
        budget.max_tokens = fitted_output(budget.max_tokens, limit, least_prompt_tokens)
        if budget.max_tokens < 1:
            return no_room(least_prompt_tokens, limit, line.number, prompt_param)
        # Stored as the line's budget: what is reserved, and what a resumed run
        # continues from; each run sends the engine what is left of it.
        line.body["max_tokens"] = budget.max_tokens
        budget.rewritten = True
    elif budget.max_tokens > limit:
        return line.error(
            "max_tokens_too_large",
            f"max_tokens {budget.max_tokens} exceeds the batch limit of {limit} tokens per "
            "sequence",
            "body.max_tokens",
        )
    elif least_prompt_tokens + budget.max_tokens > limit:
        return line.error(
            "request_too_long",
            f"the prompt is at least {least_prompt_tokens} tokens; "
            f"with max_tokens {budget.max_tokens} it exceeds the batch limit of {limit}",
            prompt_param,
        )
    return None


def generated_item(
    line: RequestLine,
    endpoint: str,
    chars: PromptChars,
    budget: OutputBudget,
    limits: InputLimits,
    tally: Tally,
) -> NewItem | LineError:
    """A chat or completions line past its prompt and budget checks: the batch-only rules,
    the class limit, then the item (pointing at the line's bytes where they are its body)."""
    refused = _batch_only_error(line, endpoint) or _fitted(
        line, budget, chars, limits, f"body.{PROMPT_FIELD[endpoint]}"
    )
    if refused is not None:
        return refused
    tally.lines += 1
    # Every prompt of a line is a sequence of its own, with its own output budget.
    tally.max_output_tokens += budget.max_tokens * chars.prompts
    tally.prompt_chars += chars.total
    span = (
        body_span(line.raw, line.body) if line.spot is not None and not budget.rewritten else None
    )
    if span is None:
        return NewItem(
            line.number,
            line.custom_id,
            dumps(line.body),
            budget.max_tokens,
            output_defaulted=budget.defaulted,
        )
    assert line.spot is not None
    return NewItem(
        line.number,
        line.custom_id,
        None,
        budget.max_tokens,
        output_defaulted=budget.defaulted,
        body_seq=line.spot[0],
        body_at=line.spot[1] + span[0],
        body_len=span[1],
    )


def no_room(least_prompt_tokens: int, limit: int, number: int, param: str) -> LineError:
    """A line without an output budget whose prompt alone fills the limit."""
    return LineError(
        "request_too_long",
        f"the prompt is at least {least_prompt_tokens} tokens; it leaves no room for output "
        f"within the batch limit of {limit} tokens per sequence",
        number,
        param,
    )
