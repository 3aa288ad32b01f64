"""The requests a summarisation job sends: one chat request per map step (a chunk) and per
reduce step (the summaries it combines), as Batch API lines.

A step's ``custom_id`` names its document and its node in the document's reduce tree
(``"<document seq>:<node>"``), so a finished item is matched to its step by its id alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

CHAT_URL = "/v1/chat/completions"
DEFAULT_INSTRUCTION = "Summarise the following text in a few sentences."
REDUCE_PREAMBLE = (
    "The texts below are summaries of consecutive parts of one document, in order. "
    "Combine them into one summary of the whole document. "
)
SUMMARY_SEPARATOR = "\n\n---\n\n"
SEPARATOR_TOKENS = 8
"""An upper bound of the tokens one separator adds between two summaries."""


def map_messages(instruction: str, text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{instruction}\n\n{text}"}]


def reduce_messages(instruction: str, summaries: Sequence[str]) -> list[dict[str, str]]:
    joined = SUMMARY_SEPARATOR.join(s.strip() for s in summaries)
    return [{"role": "user", "content": f"{REDUCE_PREAMBLE}{instruction}\n\n{joined}"}]


def custom_id(seq: int, node: int) -> str:
    return f"{seq}:{node}"


def parse_custom_id(value: str) -> tuple[int, int] | None:
    """The ``(document seq, node)`` of a step's item, or None for an id no step made."""
    seq, sep, node = value.partition(":")
    if not sep or not seq.isdigit() or not node.isdigit():
        return None
    return int(seq), int(node)


SAMPLING_BOUNDS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "top_k": (-1, 1_000_000),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.01, 10.0),
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
}
"""The sampling settings a job may give its steps (every step, map and reduce, gets the
same), with the range each takes. No ``seed``: vLLM's CPU engine fails a seeded request
whose prefill is chunked, which a long chunk's is."""
INTEGER_SAMPLING = frozenset({"top_k"})


def sampling_problem(sampling: Mapping[str, object]) -> str | None:
    """What is wrong with a job's sampling settings, or None: a setting not known, a value
    that is not a number, or out of its range."""
    for name, value in sampling.items():
        if name not in SAMPLING_BOUNDS:
            known = ", ".join(sorted(SAMPLING_BOUNDS))
            return f"sampling setting {name!r} is not known; give one of {known}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"sampling setting {name!r} must be a number"
        if name in INTEGER_SAMPLING and not isinstance(value, int):
            return f"sampling setting {name!r} must be an integer"
        low, high = SAMPLING_BOUNDS[name]
        if not low <= value <= high:
            return f"sampling setting {name!r} must be between {low:g} and {high:g}"
    return None


def request_body(
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    sampling: Mapping[str, float] | None = None,
) -> bytes:
    """A step's request body (JSON): what it stores until its batch is made."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, **(sampling or {})}
    body["messages"] = messages
    return json.dumps(body, ensure_ascii=False).encode()


def batch_line(seq: int, node: int, body: bytes) -> bytes:
    """The step's Batch API input line (with its newline), around its stored body."""
    head = json.dumps({"custom_id": custom_id(seq, node), "method": "POST", "url": CHAT_URL})
    return head[:-1].encode() + b', "body": ' + body + b"}\n"


LINE_OVERHEAD = len(batch_line(2**31 - 1, 2**31 - 1, b""))
"""Bytes a line adds around its body, at most (the longest numbers a step has)."""
