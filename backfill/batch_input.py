"""Checking a batch input file (OpenAI's JSONL) before any of it is stored or run.

Two stages, cheapest first:

* ``backfill.upload_scan`` at upload: size, line count and line length, by scanning bytes.
* :func:`validate_batch_input` at batch creation: every line parsed and checked against the
  batch's endpoint. Either every line is valid and the result holds the items to insert, or
  the result lists what is wrong, line by line, and nothing is stored. A line is checked by
  its endpoint's checker (``backfill.batch_checkers``) over the rules every endpoint shares
  (``backfill.batch_lines``: the envelope, the field rules).

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

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from backfill.batch_checkers import checked_lines
from backfill.batch_lines import (
    CHARS_PER_TOKEN_ESTIMATE,
    MAX_CUSTOM_ID_CHARS,
    PROMPT_FIELD,
    InputLimits,
    LineError,
    LineSpot,
    PromptChars,
    Tally,
)
from backfill.batch_lines import loads as _loads
from backfill.prefill import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES
from backfill.store import NewItem

__all__ = [
    "CHARS_PER_TOKEN_ESTIMATE",
    "CHAT",
    "COMPLETIONS",
    "EMBEDDINGS",
    "MAX_CUSTOM_ID_CHARS",
    "MAX_REPORTED_ERRORS",
    "MAX_TOKENS_FIELD",
    "PROMPT_FIELD",
    "RESPONSES",
    "InputLimits",
    "InputLines",
    "InvalidBatch",
    "LineError",
    "LineInvalid",
    "LineSpot",
    "LocatedLines",
    "PromptChars",
    "Tally",
    "ValidatedBatch",
    "_loads",
    "forecast_tokens_upper_bound",
    "stream_valid_items",
    "validate_batch_input",
]

MAX_REPORTED_ERRORS = 100
"""A file with a systematic mistake would otherwise report it 50,000 times."""


@dataclass(slots=True)
class ValidatedBatch:
    """Every line of the file, valid, ready for ``Repository.ingest.insert_items``."""

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


def validate_batch_input(
    content: InputLines, endpoint: str, limits: InputLimits
) -> ValidatedBatch | InvalidBatch:
    """Check every line of ``content`` for a batch on ``endpoint``."""
    tally = Tally()
    items: list[NewItem] = []
    lines = checked_lines(_lines_of(content), endpoint, limits, tally)
    for checked in lines:
        if isinstance(checked, LineError):
            return InvalidBatch(_every_error(checked, lines))
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
    """Raised by :func:`stream_valid_items` when the file is invalid (before any row is stored):
    ``errors`` names every problem, as :func:`validate_batch_input` does."""

    def __init__(self, errors: list[LineError]) -> None:
        super().__init__(errors[0].message)
        self.errors = errors


def stream_valid_items(
    content: InputLines, endpoint: str, limits: InputLimits, tally: Tally
) -> Iterator[NewItem]:
    """The items of a file, yielded as each line checks out (spooled by ``Ingest.insert_items``,
    which stores none before the last is checked); at the first problem it yields no more, checks
    the rest of the lines and raises :class:`LineInvalid` with every problem (one pass over the
    file, whatever its errors). ``tally`` holds the totals once the iterator is exhausted."""
    lines = checked_lines(_lines_of(content), endpoint, limits, tally)
    for checked in lines:
        if isinstance(checked, LineError):
            raise LineInvalid(_every_error(checked, lines))
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
