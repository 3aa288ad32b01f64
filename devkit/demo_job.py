"""The demo job's parts: the bundled documents, the prompt and sampling that summarise them,
the batch lines ``backfill dev`` submits, and the checks its summaries are judged by
(``python -m bench.demo_summaries`` runs those over every document).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# Public-domain texts (US founding documents, the King James Bible, and poems published before
# 1929), one document a file; nothing else in the folder, which README's tour summarises whole.
DOCS = Path(__file__).parent / "demo_docs"
PROMPT = (
    "Summarise the following document in two or three sentences of your own. Say what it "
    "is and what it says; do not copy its lines.\n\nDocument:\n{text}"
)
# SmolLM2-135M decoding greedily with no penalty copied a document's title or refrain, once
# or several times (a poem's title line four times). Greedy with a mild repetition penalty
# keeps the bundled documents' summaries free of repeated and copied lines (checked on all of
# them by ``python -m bench.demo_summaries``). No ``seed``: vLLM's CPU engine dies on a seeded
# request whose prefill is chunked ("CPU Generator does not use offset"), which a batch of
# all the documents at once is.
SAMPLING: dict[str, float | int] = {"temperature": 0, "repetition_penalty": 1.1}
RANDOM_WEIGHTS = frozenset({"tiny"})
"""Models of random weights, for trying the machinery: greedy, ``tiny`` picks tokens that
decode to nothing, and every summary would be empty (a failed step); the engine's own
sampling gives text."""


def demo_sampling(model: str) -> dict[str, float | int]:
    """The summary job's sampling settings for ``model``."""
    return {} if model in RANDOM_WEIGHTS else dict(SAMPLING)


TERMINAL = {"completed", "failed", "expired", "cancelled"}


def repeated_lines(text: str) -> int:
    """How many of ``text``'s non-empty lines (or sentences, in one-line text) repeat an
    earlier one, ignoring case and punctuation at the ends: a summary that loops scores > 0."""
    seen: set[str] = set()
    repeats = 0
    for key in _line_keys(text):
        repeats += key in seen
        seen.add(key)
    return repeats


def copied_lines(summary: str, document: str) -> int:
    """How many of ``summary``'s lines (or sentences) are one of ``document``'s lines word for
    word (its title, a refrain): a summary should say it in its own words."""
    source = set(_line_keys(document))
    return sum(1 for key in _line_keys(summary) if key in source)


def _line_keys(text: str) -> list[str]:
    parts = [p for line in text.splitlines() for p in re.split(r"(?<=[.!?])\s+", line)]
    keys = (part.strip().strip(".,;:!?\"'*#-").strip().lower() for part in parts)
    return [key for key in keys if key]


CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"


def batch_lines(docs: Path, model: str, max_tokens: int, endpoint: str = CHAT) -> bytes:
    """One line per document: a request for its summary, or (``/v1/embeddings``) for the
    embedding of its text."""
    lines = []
    for path in sorted(docs.glob("*.txt")):
        text = path.read_text().strip()
        body: dict[str, object] = (
            {"model": model, "input": text}
            if endpoint == EMBEDDINGS
            else {
                "model": model,
                "max_tokens": max_tokens,
                **SAMPLING,
                "messages": [{"role": "user", "content": PROMPT.format(text=text)}],
            }
        )
        lines.append(
            json.dumps({"custom_id": path.stem, "method": "POST", "url": endpoint, "body": body})
        )
    if not lines:
        raise SystemExit(f"no .txt documents in {docs}")
    return ("\n".join(lines) + "\n").encode()
