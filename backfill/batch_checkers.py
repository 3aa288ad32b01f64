"""A checker per endpoint a batch may target (chat completions, completions, embeddings,
responses), over the shared rules of ``backfill.batch_lines``, and the loop that checks each
line of a file with its endpoint's checker."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

from backfill.batch_lines import (
    InputLimits,
    LineError,
    LineSpot,
    PromptChars,
    RequestLine,
    Tally,
    dumps,
    generated_item,
    given_budget,
    is_positive_int,
    no_room,
    normalised,
    prompt_of,
    request_line,
)
from backfill.content_parts import MediaPolicy, media_part
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
from backfill.request_fields import normalise_fields
from backfill.responses import check_responses_body, responses_text_chars
from backfill.store import NewItem

LineChecker = Callable[[RequestLine, InputLimits, Tally], NewItem | LineError]
"""An endpoint's check of a line's body: the item to store, or why the line is refused."""


def checked_lines(
    lines: Iterable[tuple[bytes, LineSpot | None]], endpoint: str, limits: InputLimits, tally: Tally
) -> Iterator[NewItem | LineError]:
    """Each request line of ``lines`` (with where it lies in the stored file, if known),
    checked: a NewItem if valid, else a LineError. The envelope is checked alike for every
    endpoint, the body by the endpoint's checker."""
    check_body = _CHECKERS[endpoint]
    seen: set[str] = set()
    for number, (raw, spot) in enumerate(lines, start=1):
        if not raw.strip():
            continue
        line = request_line(raw, spot, number, endpoint, limits, seen, tally)
        yield line if isinstance(line, LineError) else check_body(line, limits, tally)


def _chat_prompt_chars(messages: Any, media: MediaPolicy) -> PromptChars | str:
    """Characters of the prompt's text, or a message saying why ``messages`` is invalid
    (a media part that ``media`` refuses among the reasons). A media part's tokens are not
    in the characters: the lower bound stays one, and the exact count at run time covers
    them."""
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
    refused = media_part(messages, "body.messages", media)
    if refused is not None:
        return refused
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
    return sum(len(dumps({key: body[key]})) for key in _RENDERED_BESIDE_MESSAGES if body.get(key))


def _chat_item(line: RequestLine, limits: InputLimits, tally: Tally) -> NewItem | LineError:
    """A ``/v1/chat/completions`` line: its messages, its budget (``max_completion_tokens``
    or ``max_tokens``), and the fields the template renders beside the messages counted
    toward the forecasts."""
    chars = prompt_of(line, CHAT, partial(_chat_prompt_chars, media=limits.media), limits)
    if isinstance(chars, LineError):
        return chars
    rewritten = normalised(line, chat=True)
    if isinstance(rewritten, LineError):
        return rewritten
    budget = given_budget(line, limits, rewritten)
    if isinstance(budget, LineError):
        return budget
    item = generated_item(line, CHAT, chars, budget, limits, tally)
    if isinstance(item, NewItem):
        tally.prompt_chars += _rendered_chars(line.body)
    return item


def _completions_item(line: RequestLine, limits: InputLimits, tally: Tally) -> NewItem | LineError:
    """A ``/v1/completions`` line: its prompt (a string, token ids, or a list of either, each
    a sequence of its own) and its budget, in ``max_tokens`` alone."""
    chars = prompt_of(line, COMPLETIONS, _completion_prompt_chars, limits)
    if isinstance(chars, LineError):
        return chars
    rewritten = normalised(line, chat=False)
    if isinstance(rewritten, LineError):
        return rewritten
    moved = _completions_budget_field(line)
    if isinstance(moved, LineError):
        return moved
    budget = given_budget(line, limits, rewritten or moved)
    if isinstance(budget, LineError):
        return budget
    return generated_item(line, COMPLETIONS, chars, budget, limits, tally)


def _completions_budget_field(line: RequestLine) -> bool | LineError:
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


def _embeddings_item(line: RequestLine, limits: InputLimits, tally: Tally) -> NewItem | LineError:
    """A ``/v1/embeddings`` line: its body against the allowlist
    (:func:`check_embedding_body`), its inputs; no output, so no ``max_tokens``; the class
    limit bounds each input alone."""
    refused = check_embedding_body(line.body)
    if refused is not None:
        return line.error(refused.code, refused.message, f"body.{refused.param}")
    chars = prompt_of(line, EMBEDDINGS, _embedding_input_chars, limits)
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
    return NewItem(line.number, line.custom_id, dumps(line.body), 0)


def _output_budget(body: dict[str, Any]) -> int | str | None:
    """A Responses line's ``max_output_tokens`` (None when absent or null), or why it is
    invalid."""
    value = body.get("max_output_tokens")
    if value is None:
        return None
    if type(value) is float and math.isfinite(value) and value.is_integer():
        value = body["max_output_tokens"] = int(value)
    if not is_positive_int(value):
        return "body.max_output_tokens must be a positive integer"
    assert isinstance(value, int)
    return value


def _responses_item(line: RequestLine, limits: InputLimits, tally: Tally) -> NewItem | LineError:
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
            return no_room(least_prompt_tokens, limit, number, "body.input")
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
    tally.prompt_chars += chars + (len(dumps({"tools": body["tools"]})) if body.get("tools") else 0)
    return NewItem(number, custom_id, dumps(body), max_output, output_defaulted=given is None)


_CHECKERS: dict[str, LineChecker] = {
    CHAT: _chat_item,
    COMPLETIONS: _completions_item,
    EMBEDDINGS: _embeddings_item,
    RESPONSES: _responses_item,
}
"""The checker of each endpoint a batch may target (the keys of :data:`PROMPT_FIELD`)."""
