"""Checking a batch input file (OpenAI's JSONL) before any of it is stored or run.

Two stages, cheapest first:

* ``backfill.upload_scan`` at upload: size, line count and line length, by scanning bytes.
* :func:`validate_batch_input` at batch creation: every line parsed and checked against the
  batch's endpoint. Either every line is valid and the result holds the items to insert, or
  the result lists what is wrong, line by line, and nothing is stored.

Token limits are checked here only where the answer is certain. A token of a byte-level
vocabulary covers at most ``max_bytes_per_token`` bytes, and a character is at least one byte,
so ``ceil(prompt characters / max_bytes_per_token)`` is a lower bound on prompt tokens: a line
whose bound plus ``max_tokens`` already exceeds the class limit can never run. A line without
``max_tokens`` is never refused for the default: it is stored with what the limit leaves the
bound, at most the default (``backfill.output_budget``), and refused only where its prompt
alone fills the limit. Exact counts come from the engine's own tokenizer in the worker, before
any engine work.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pydantic_core

from backfill.config import Settings
from backfill.content_parts import media_part
from backfill.embeddings import check_embedding_body
from backfill.output_budget import fitted_output
from backfill.prefill import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    RESPONSES,
    completion_prompts,
    embedding_inputs,
    prefill_plan,
)
from backfill.refusals import InvalidRequest
from backfill.request_fields import INTEGER_FIELDS, normalise_fields
from backfill.responses import check_responses_body, responses_text_chars
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
MAX_REPORTED_ERRORS = 100
"""A file with a systematic mistake would otherwise report it 50,000 times."""

_INTEGER_FIELDS = INTEGER_FIELDS | {"logprobs"}
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

    @classmethod
    def from_settings(cls, settings: Settings) -> InputLimits:
        return cls(
            max_file_bytes=settings.max_file_bytes,
            max_line_bytes=settings.max_line_bytes,
            max_lines=settings.max_lines_per_batch,
            max_sequence_tokens=settings.batch_max_sequence_tokens,
            max_bytes_per_token=settings.max_bytes_per_token,
            max_prompts_per_line=settings.batch_max_prompts_per_line,
            default_max_tokens=settings.batch_default_max_tokens,
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


@dataclass(slots=True)
class ValidatedBatch:
    """Every line of the file, valid, ready for ``Repository.insert_items``."""

    items: list[NewItem]
    model: str
    max_output_tokens: int
    estimated_prompt_tokens: int

    @property
    def estimated_tokens(self) -> int:
        """Worst-case output plus estimated prompt tokens: what forecasts charge the batch."""
        return self.max_output_tokens + self.estimated_prompt_tokens


@dataclass(slots=True)
class InvalidBatch:
    """Why the file was refused; ``errors`` is capped at :data:`MAX_REPORTED_ERRORS`."""

    errors: list[LineError] = field(default_factory=list)


LineSpot = tuple[int, int, int]
"""Where a line of a stored file lies: (piece, first byte in it, length)."""


class LocatedLines:
    """A stored file's lines, each with where it lies in the file's pieces (None where it
    lies over two): ``backfill.upload_scan.iter_located_lines``. An item whose line can
    stand for its body is stored pointing at it (``backfill.store.bodies``)."""

    __slots__ = ("_lines",)

    def __init__(self, lines: Iterable[tuple[bytes, LineSpot | None]]) -> None:
        self._lines = lines

    def __iter__(self) -> Iterator[tuple[bytes, LineSpot | None]]:
        return iter(self._lines)


InputLines = bytes | Iterable[bytes] | LocatedLines
"""A file to validate: its bytes, its lines (``backfill.upload_scan.iter_lines``), or its
lines with where each lies in the stored file."""


def _lines_of(content: InputLines) -> Iterable[tuple[bytes, LineSpot | None]]:
    if isinstance(content, LocatedLines):
        return content
    lines = content.split(b"\n") if isinstance(content, bytes) else content
    return ((raw, None) for raw in lines)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _loads(raw: bytes) -> Any:
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


def _dumps(body: dict[str, Any]) -> str:
    try:
        return pydantic_core.to_json(body).decode()
    except (ValueError, TypeError):
        # Integers beyond 64 bits: rare enough to take the slow, exact path.
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def _is_positive_int(value: Any) -> bool:
    return type(value) is int and value > 0


@dataclass(frozen=True, slots=True)
class PromptChars:
    """The characters of a line's prompts: the longest bounds the class limit check (each
    prompt is a sequence of its own), all of them together feed the forecasts."""

    longest: int
    total: int
    prompts: int = 1


def _chat_prompt_chars(messages: Any) -> PromptChars | str:
    """Characters of the prompt's text, or a message saying why ``messages`` is invalid."""
    if type(messages) is not list or not messages:
        return "body.messages must be a non-empty array of message objects"
    chars = 0
    for index, message in enumerate(messages):
        if type(message) is not dict or type(message.get("role")) is not str:
            return f"body.messages[{index}] must be an object with a string 'role'"
        content = message.get("content")
        if type(content) is str:
            chars += len(content)
        elif type(content) is list:
            for part in content:
                text = part.get("text") if type(part) is dict else None
                if type(text) is str:
                    chars += len(text)
        elif content is not None:
            return f"body.messages[{index}].content must be a string, an array or null"
    media = media_part(messages, "body.messages")
    if media is not None:
        return media
    return PromptChars(chars, chars)


def _prompt_list_chars(
    prompt: Any, field: str, prompts_of: Callable[[Any], list[str | list[int]]]
) -> PromptChars | str:
    """Characters of a completions prompt or an embeddings input, each entry of a list apart
    (token ids count as one character each, which keeps the bound a lower one: one id is
    exactly one token)."""
    if type(prompt) is str:
        return (
            PromptChars(len(prompt), len(prompt)) if prompt else f"body.{field} must not be empty"
        )
    try:
        prompts = prompts_of(prompt)
    except InvalidRequest as exc:
        return exc.message
    sizes = [len(p) for p in prompts]
    if not all(sizes):
        return f"body.{field} must not hold an empty {field}"
    return PromptChars(max(sizes), sum(sizes), len(sizes))


def _completion_prompt_chars(prompt: Any) -> PromptChars | str:
    return _prompt_list_chars(prompt, "prompt", completion_prompts)


def _embedding_input_chars(value: Any) -> PromptChars | str:
    return _prompt_list_chars(value, "input", embedding_inputs)


_RENDERED_BESIDE_MESSAGES = ("tools", "documents", "chat_template_kwargs")
"""Chat fields the template renders into the prompt beside the messages: their JSON size
counts toward the forecasts (not toward the limit's lower bound: a template may leave them
out)."""


def _rendered_chars(body: dict[str, Any]) -> int:
    return sum(len(_dumps({key: body[key]})) for key in _RENDERED_BESIDE_MESSAGES if body.get(key))


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
class _Line:
    """A request line whose envelope checked out, for its endpoint's checker: the body is
    rewritten in place where the stored body differs from the line's."""

    number: int
    raw: bytes
    spot: LineSpot | None
    custom_id: str
    body: dict[str, Any]

    def error(self, code: str, message: str, param: str | None) -> LineError:
        return LineError(code, message, self.number, param)


LineChecker = Callable[[_Line, InputLimits, Tally], NewItem | LineError]
"""An endpoint's check of a line's body: the item to store, or why the line is refused."""


def _checked_lines(
    content: InputLines, endpoint: str, limits: InputLimits, tally: Tally
) -> Iterator[NewItem | LineError]:
    """Each request line of ``content``, checked: a NewItem if valid, else a LineError. The
    envelope is checked alike for every endpoint, the body by the endpoint's checker."""
    check_body = _CHECKERS[endpoint]
    seen: set[str] = set()
    for number, (raw, spot) in enumerate(_lines_of(content), start=1):
        if not raw.strip():
            continue
        line = _request_line(raw, spot, number, endpoint, limits, seen, tally)
        yield line if isinstance(line, LineError) else check_body(line, limits, tally)


# The envelope: rules every endpoint shares.


def _request_line(
    raw: bytes,
    spot: LineSpot | None,
    number: int,
    endpoint: str,
    limits: InputLimits,
    seen: set[str],
    tally: Tally,
) -> _Line | LineError:
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
    line = _Line(number, raw, spot, custom_id, body)
    return _model_error(line, tally) or line


def _request_of(raw: bytes, number: int, limits: InputLimits) -> dict[str, Any] | LineError:
    if len(raw) > limits.max_line_bytes:
        return LineError(
            "line_too_long",
            f"line is {len(raw)} bytes; the limit is {limits.max_line_bytes}",
            number,
        )
    try:
        request = _loads(raw)
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


def _model_error(line: _Line, tally: Tally) -> LineError | None:
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


def _prompt_of(
    line: _Line,
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


def _normalised(line: _Line, *, chat: bool) -> bool | LineError:
    """The body's fields in the engine's types (an integral float an integer) and a null
    budget dropped (null means "not given", as at OpenAI); whether that rewrote the body."""
    body = line.body
    rewritten = any(type(body[key]) is float for key in _INTEGER_FIELDS.intersection(body))
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
class _Budget:
    """A generating line's output budget: given, or the default (``defaulted``); whether the
    stored body differs from the line's (then the item keeps a copy)."""

    max_tokens: int
    defaulted: bool
    rewritten: bool


def _given_budget(line: _Line, limits: InputLimits, rewritten: bool) -> _Budget | LineError:
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
    if not _is_positive_int(max_tokens) or (
        "max_tokens" in body and not _is_positive_int(body["max_tokens"])
    ):
        return line.error(
            "invalid_max_tokens", "max_tokens must be a positive integer", "body.max_tokens"
        )
    if "max_tokens" in body:
        max_tokens = max(max_tokens, body["max_tokens"])
    return _Budget(max_tokens, defaulted, rewritten)


def _batch_only_error(line: _Line, endpoint: str) -> LineError | None:
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
    line: _Line, budget: _Budget, chars: PromptChars, limits: InputLimits, prompt_param: str
) -> LineError | None:
    """The class limit's lower bound: a given budget must fit beside the prompt, a default
    is cut to what the prompt leaves (and written into the body)."""
    limit = limits.max_sequence_tokens
    least_prompt_tokens = math.ceil(chars.longest / limits.max_bytes_per_token)
    if budget.defaulted:
        budget.max_tokens = fitted_output(budget.max_tokens, limit, least_prompt_tokens)
        if budget.max_tokens < 1:
            return _no_room(least_prompt_tokens, limit, line.number, prompt_param)
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


def _generated_item(
    line: _Line,
    endpoint: str,
    chars: PromptChars,
    budget: _Budget,
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
            _dumps(line.body),
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


# A checker per endpoint.


def _chat_item(line: _Line, limits: InputLimits, tally: Tally) -> NewItem | LineError:
    """A ``/v1/chat/completions`` line: its messages, its budget (``max_completion_tokens``
    or ``max_tokens``), and the fields the template renders beside the messages counted
    toward the forecasts."""
    chars = _prompt_of(line, CHAT, _chat_prompt_chars, limits)
    if isinstance(chars, LineError):
        return chars
    rewritten = _normalised(line, chat=True)
    if isinstance(rewritten, LineError):
        return rewritten
    budget = _given_budget(line, limits, rewritten)
    if isinstance(budget, LineError):
        return budget
    item = _generated_item(line, CHAT, chars, budget, limits, tally)
    if isinstance(item, NewItem):
        tally.prompt_chars += _rendered_chars(line.body)
    return item


def _completions_item(line: _Line, limits: InputLimits, tally: Tally) -> NewItem | LineError:
    """A ``/v1/completions`` line: its prompt (a string, token ids, or a list of either, each
    a sequence of its own) and its budget, in ``max_tokens`` alone."""
    chars = _prompt_of(line, COMPLETIONS, _completion_prompt_chars, limits)
    if isinstance(chars, LineError):
        return chars
    rewritten = _normalised(line, chat=False)
    if isinstance(rewritten, LineError):
        return rewritten
    moved = _completions_budget_field(line)
    if isinstance(moved, LineError):
        return moved
    budget = _given_budget(line, limits, rewritten or moved)
    if isinstance(budget, LineError):
        return budget
    return _generated_item(line, COMPLETIONS, chars, budget, limits, tally)


def _completions_budget_field(line: _Line) -> bool | LineError:
    """``max_completion_tokens`` moved to ``max_tokens``: vLLM's completions request has no
    such field: it would ignore it and generate its own default (16 per prompt) past a
    reservation sized on it. Whether the body was rewritten."""
    body = line.body
    if "max_completion_tokens" not in body:
        return False
    if "max_tokens" in body:
        return line.error(
            "invalid_parameter",
            "a /v1/completions line takes max_tokens; max_completion_tokens is a chat "
            "field (give max_tokens alone)",
            "body.max_completion_tokens",
        )
    body["max_tokens"] = body.pop("max_completion_tokens")
    return True


def _embeddings_item(line: _Line, limits: InputLimits, tally: Tally) -> NewItem | LineError:
    """A ``/v1/embeddings`` line: its body against the allowlist
    (:func:`check_embedding_body`), its inputs; no output, so no ``max_tokens``; the class
    limit bounds each input alone."""
    refused = check_embedding_body(line.body)
    if refused is not None:
        return line.error(refused.code, refused.message, f"body.{refused.param}")
    chars = _prompt_of(line, EMBEDDINGS, _embedding_input_chars, limits)
    if isinstance(chars, LineError):
        return chars
    try:
        prefill_plan(EMBEDDINGS, line.body)
    except InvalidRequest as exc:
        return line.error(exc.code, exc.message, f"body.{exc.param or 'input'}")
    limit = limits.max_sequence_tokens
    least_prompt_tokens = math.ceil(chars.longest / limits.max_bytes_per_token)
    if least_prompt_tokens > limit:
        return line.error(
            "request_too_long",
            f"an input is at least {least_prompt_tokens} tokens; it exceeds the batch limit "
            f"of {limit}",
            "body.input",
        )
    tally.lines += 1
    tally.prompt_chars += chars.total
    tally.embedding_inputs += chars.prompts
    return NewItem(line.number, line.custom_id, _dumps(line.body), 0)


def _no_room(least_prompt_tokens: int, limit: int, number: int, param: str) -> LineError:
    """A line without an output budget whose prompt alone fills the limit."""
    return LineError(
        "request_too_long",
        f"the prompt is at least {least_prompt_tokens} tokens; it leaves no room for output "
        f"within the batch limit of {limit} tokens per sequence",
        number,
        param,
    )


def _output_budget(body: dict[str, Any]) -> int | str | None:
    """A Responses line's ``max_output_tokens`` (None when absent or null), or why it is
    invalid."""
    value = body.get("max_output_tokens")
    if value is None:
        return None
    if type(value) is float and math.isfinite(value) and value.is_integer():
        value = body["max_output_tokens"] = int(value)
    if not _is_positive_int(value):
        return "body.max_output_tokens must be a positive integer"
    assert isinstance(value, int)
    return value


def _responses_item(line: _Line, limits: InputLimits, tally: Tally) -> NewItem | LineError:
    """A ``/v1/responses`` line (``backfill.responses``): its body checked against the
    allowlist, its prompt rendered as vLLM renders it (which refuses what cannot be counted),
    its output budget given or defaulted, and the class limit's lower bound."""
    number, custom_id, body = line.number, line.custom_id, line.body
    refused = check_responses_body(body)
    if refused is None:
        malformed = normalise_fields(body, chat=True)
        if malformed is not None:
            param, message = malformed
            refused = InvalidRequest(message, code="invalid_parameter", param=param)
    if refused is None:
        try:
            prefill_plan(RESPONSES, body)
            chars = responses_text_chars(body)
        except InvalidRequest as exc:
            refused = exc
    if refused is not None:
        code = "invalid_input" if refused.code == "invalid_request" else refused.code
        return LineError(code, refused.message, number, f"body.{refused.param or 'input'}")
    given = _output_budget(body)
    if isinstance(given, str):
        return LineError("invalid_max_tokens", given, number, "body.max_output_tokens")
    limit = limits.max_sequence_tokens
    least_prompt_tokens = math.ceil(chars / limits.max_bytes_per_token)
    if given is None:
        # As a chat line without max_tokens: what the limit leaves the prompt, at most the
        # default, written in (and fitted to the exact prompt at each run).
        max_output = fitted_output(limits.default_max_tokens, limit, least_prompt_tokens)
        if max_output < 1:
            return _no_room(least_prompt_tokens, limit, number, "body.input")
        body["max_output_tokens"] = max_output
    elif given > limit:
        return LineError(
            "max_tokens_too_large",
            f"max_output_tokens {given} exceeds the batch limit of {limit} tokens per sequence",
            number,
            "body.max_output_tokens",
        )
    elif least_prompt_tokens + given > limit:
        return LineError(
            "request_too_long",
            f"the prompt is at least {least_prompt_tokens} tokens; with max_output_tokens "
            f"{given} it exceeds the batch limit of {limit}",
            number,
            "body.input",
        )
    else:
        max_output = given
    tally.lines += 1
    tally.max_output_tokens += max_output
    tally.prompt_chars += chars + (
        len(_dumps({"tools": body["tools"]})) if body.get("tools") else 0
    )
    return NewItem(number, custom_id, _dumps(body), max_output, output_defaulted=given is None)


_CHECKERS: dict[str, LineChecker] = {
    CHAT: _chat_item,
    COMPLETIONS: _completions_item,
    EMBEDDINGS: _embeddings_item,
    RESPONSES: _responses_item,
}
"""The checker of each endpoint a batch may target (the keys of :data:`PROMPT_FIELD`)."""


def validate_batch_input(
    content: InputLines, endpoint: str, limits: InputLimits
) -> ValidatedBatch | InvalidBatch:
    """Check every line of ``content`` for a batch on ``endpoint``."""
    tally = Tally()
    items: list[NewItem] = []
    checked_lines = _checked_lines(content, endpoint, limits, tally)
    for checked in checked_lines:
        if isinstance(checked, LineError):
            return InvalidBatch(_every_error(checked, checked_lines))
        items.append(checked)
    if errors := _file_errors(tally, limits):
        return InvalidBatch(errors)
    assert tally.model is not None
    return ValidatedBatch(
        items=items,
        model=tally.model,
        max_output_tokens=tally.max_output_tokens,
        estimated_prompt_tokens=tally.estimated_prompt_tokens,
    )


def _every_error(first: LineError, rest: Iterator[NewItem | LineError]) -> list[LineError]:
    """``first`` and every later line's error (the rest of the lines still checked), at most
    ``MAX_REPORTED_ERRORS`` of them and then how many more."""
    errors = [first]
    more = 0
    for checked in rest:
        if isinstance(checked, LineError):
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(checked)
            else:
                more += 1
    if more:
        errors.append(LineError("too_many_errors", f"{more} more errors not listed"))
    return errors


def _file_errors(tally: Tally, limits: InputLimits) -> list[LineError]:
    if not tally.lines:
        return [LineError("empty_file", "file has no request lines", None, "input_file_id")]
    if tally.lines > limits.max_lines:
        return [
            LineError(
                "too_many_lines",
                f"file has {tally.lines} request lines; the limit is {limits.max_lines}",
                None,
                "input_file_id",
            )
        ]
    if tally.embedding_inputs > limits.max_embedding_inputs:
        return [
            LineError(
                "too_many_inputs",
                f"file has {tally.embedding_inputs} embedding inputs; a batch may hold at most "
                f"{limits.max_embedding_inputs}",
                None,
                "input_file_id",
            )
        ]
    return []


class LineInvalid(Exception):
    """Raised by :func:`stream_valid_items` when the file is invalid (rolls back a COPY):
    ``errors`` names every problem, as :func:`validate_batch_input` does."""

    def __init__(self, errors: list[LineError]) -> None:
        super().__init__(errors[0].message)
        self.errors = errors


def stream_valid_items(
    content: InputLines, endpoint: str, limits: InputLimits, tally: Tally
) -> Iterator[NewItem]:
    """The items of a file, yielded as each line checks out, so storing them can overlap
    parsing; at the first problem it yields no more, checks the rest of the lines and raises
    :class:`LineInvalid` with every problem (one pass over the file, whatever its errors).
    ``tally`` holds the totals once the iterator is exhausted."""
    checked_lines = _checked_lines(content, endpoint, limits, tally)
    for checked in checked_lines:
        if isinstance(checked, LineError):
            raise LineInvalid(_every_error(checked, checked_lines))
        yield checked
    if errors := _file_errors(tally, limits):
        raise LineInvalid(errors)


MAX_TOKENS_FIELD = re.compile(rb'"max_(?:completion_|output_)?tokens"\s*:\s*(\d{1,12})')


def forecast_tokens_upper_bound(content: bytes | Iterable[bytes]) -> int:
    """An upper bound of the tokens forecasts charge a file, from one regex scan (no JSON
    parse): every ``max_tokens``/``max_completion_tokens``/``max_output_tokens`` number
    counts, and every byte is counted toward the prompt estimate. It is at least
    ``ValidatedBatch.estimated_tokens`` for any file whose keys are written plainly (JSON
    allows escaped keys; those files are caught by the exact totals afterwards)."""
    if isinstance(content, bytes):
        max_output = sum(int(m) for m in MAX_TOKENS_FIELD.findall(content))
        return max_output + math.ceil(len(content) / CHARS_PER_TOKEN_ESTIMATE)
    max_output = size = 0
    for line in content:  # a key split over two lines is on no valid line
        max_output += sum(int(m) for m in MAX_TOKENS_FIELD.findall(line))
        size += len(line) + 1
    return max_output + math.ceil(size / CHARS_PER_TOKEN_ESTIMATE)
