"""Which chat content parts reach an engine: text only.

A chat message's ``content`` may be an array of parts. vLLM takes media parts too
(``image_url``, ``video_url``, ``audio_url``, ``input_audio``, ``file``, embeddings...) and
fetches a media URL itself, from wherever it points, unless the engine was started with
``--allowed-media-domains``: a batch line or an interactive request pointing at a cloud
metadata address or at an internal service would make the engine fetch it. Nor can a media
part be counted before admission (its tokens depend on the engine's processor). So a part is
accepted only as text, in batch and interactive chat alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TEXT_PART_TYPES = frozenset({"text", "refusal"})
"""Part types that carry text alone (``refusal`` in an assistant message is text too)."""


def media_part(messages: Sequence[Any], field: str = "messages") -> str | None:
    """A message naming the first content part of ``messages`` that is not text, or None
    when every part is (or no message holds parts)."""
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in TEXT_PART_TYPES and isinstance(part.get("text", part.get("refusal")), str):
                continue
            what = f"a part of type {kind!r}" if isinstance(kind, str) else "not a text part"
            return (
                f"{field}[{m}].content[{p}] is {what}: only text parts are accepted (an engine "
                "would fetch a media part's URL itself, and its tokens cannot be counted "
                "before admission)"
            )
    return None
