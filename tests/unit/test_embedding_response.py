"""An embeddings answer becomes a result body only with one vector per input (pure)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from backfill.engine.protocol import EngineFailed
from worker.embeddings import embedding_body


def answer(vectors: int = 2, **top: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "embd-bf-1-1",
        "object": "list",
        "created": 1,
        "model": "served-name",
        "data": [
            {"index": i, "object": "embedding", "embedding": [0.5, -0.5]} for i in range(vectors)
        ],
        "usage": {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0},
    }
    body.update(top)
    return body


def test_the_engines_body_is_kept_with_the_lines_model() -> None:
    got = embedding_body(answer(), model="line-model", inputs=2)
    assert got.prompt_tokens == 7
    assert got.body == {**answer(), "model": "line-model"}


@pytest.mark.parametrize(
    ("raw", "inputs", "why"),
    [
        (answer(1), 2, "1 embeddings for 2 inputs"),
        (answer(data=None), 2, "no data list"),
        (answer(data=[{"index": 1, "embedding": [1.0]}]), 1, "index 1 at data[0]"),
        (answer(data=[{"index": 0}]), 1, "no embedding at data[0]"),
        (answer(data=["x"]), 1, "non-object at data[0]"),
        (answer(usage={"total_tokens": 3}), 2, "no usage.prompt_tokens"),
    ],
)
def test_an_answer_without_the_shape_is_an_engine_failure(
    raw: dict[str, Any], inputs: int, why: str
) -> None:
    with pytest.raises(EngineFailed, match=re.escape(why)):
        embedding_body(raw, model="m", inputs=inputs)
