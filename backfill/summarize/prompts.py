"""The requests a summarisation job sends: one chat request per map step (a chunk) and per
reduce step (the summaries it combines), as Batch API lines.

A step's ``custom_id`` names its document and its node in the document's reduce tree
(``"<document seq>:<node>"``), so a finished item is matched to its step by its id alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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


def batch_line(
    seq: int, node: int, model: str, messages: list[dict[str, str]], max_tokens: int
) -> bytes:
    """One Batch API input line (with its newline)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": messages}
    line = {"custom_id": custom_id(seq, node), "method": "POST", "url": CHAT_URL, "body": body}
    return json.dumps(line, ensure_ascii=False).encode() + b"\n"
