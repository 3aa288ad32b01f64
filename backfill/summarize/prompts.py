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


def request_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> bytes:
    """A step's request body (JSON): what it stores until its batch is made."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": messages}
    return json.dumps(body, ensure_ascii=False).encode()


def batch_line(seq: int, node: int, body: bytes) -> bytes:
    """The step's Batch API input line (with its newline), around its stored body."""
    head = json.dumps({"custom_id": custom_id(seq, node), "method": "POST", "url": CHAT_URL})
    return head[:-1].encode() + b', "body": ' + body + b"}\n"


LINE_OVERHEAD = len(batch_line(2**31 - 1, 2**31 - 1, b""))
"""Bytes a line adds around its body, at most (the longest numbers a step has)."""
