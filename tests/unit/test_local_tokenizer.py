"""The engine's tokenizer read from its model's files (``backfill.engine.local_tokenizer``):
a real ``tokenizers`` file, counted here only as far as it agrees with the engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

from backfill.engine.local_tokenizer import CHECKS, SPOT_EVERY, CheckedCount, load_counter
from tests.support_tokenizer import word_count, write_tokenizer

TEXTS = [f"Document {i}: " + "some words, " * (i % 7 + 1) for i in range(300)]


class Engine:
    def __init__(self, off_by: int = 0) -> None:
        self.asked = 0
        self.off_by = off_by

    def __call__(self, text: str) -> int:
        self.asked += 1
        return word_count(text) + self.off_by


def test_the_files_tokenizer_counts_as_the_engine_does(tmp_path: Path) -> None:
    count = load_counter(str(write_tokenizer(tmp_path)))
    assert count is not None
    assert [count(t) for t in TEXTS[:20]] == [word_count(t) for t in TEXTS[:20]]


def test_no_file_or_an_unreadable_one_leaves_the_engine_to_count(tmp_path: Path) -> None:
    assert load_counter(None) is None
    assert load_counter("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a hub id, not a folder
    assert load_counter(str(tmp_path)) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert load_counter(str(tmp_path)) is None


def test_counts_agreeing_with_the_engine_are_answered_locally_with_spot_checks(
    tmp_path: Path,
) -> None:
    local = load_counter(str(write_tokenizer(tmp_path)))
    assert local is not None
    engine = Engine()
    checked = CheckedCount(local, "m")
    assert [checked.count(t, engine) for t in TEXTS] == [word_count(t) for t in TEXTS]
    # Red before: every count was the engine's (300 round trips).
    assert engine.asked <= CHECKS + len(TEXTS) // SPOT_EVERY + 1
    assert not checked.disagreed


def test_one_disagreement_sends_every_count_after_to_the_engine(tmp_path: Path) -> None:
    local = load_counter(str(write_tokenizer(tmp_path, start_token=False)))
    assert local is not None
    engine = Engine()
    checked = CheckedCount(local, "m")
    assert [checked.count(t, engine) for t in TEXTS] == [word_count(t) for t in TEXTS]
    assert checked.disagreed
    assert engine.asked == len(TEXTS)


def test_a_tokenizer_that_drifts_after_its_checks_is_caught_by_a_spot_check(
    tmp_path: Path,
) -> None:
    local = load_counter(str(write_tokenizer(tmp_path)))
    assert local is not None
    engine = Engine()
    checked = CheckedCount(local, "m")
    for t in TEXTS[:CHECKS]:
        checked.count(t, engine)
    engine.off_by = 1  # the engine's files changed under it
    answers = [checked.count(t, engine) for t in TEXTS[CHECKS:]]
    assert checked.disagreed
    late = TEXTS[CHECKS:]
    first_spot = next(i for i, t in enumerate(late) if answers[i] != word_count(t))
    assert first_spot < SPOT_EVERY
    after = TEXTS[CHECKS + first_spot :]
    assert answers[first_spot:] == [word_count(t) + 1 for t in after]


def test_on_an_event_loop_the_same_counts_ask_the_engine_as_seldom(tmp_path: Path) -> None:
    local = load_counter(str(write_tokenizer(tmp_path)))
    assert local is not None
    engine = Engine()
    checked = CheckedCount(local, "m")

    async def ask(text: str) -> int:
        return engine(text)

    async def counts() -> list[int]:
        long = "a long document, " * 400  # past INLINE_CHARS: counted off the loop
        return [await checked.acount(t, ask) for t in [*TEXTS, long]]

    texts = [*TEXTS, "a long document, " * 400]
    assert asyncio.run(counts()) == [word_count(t) for t in texts]
    assert engine.asked <= CHECKS + len(texts) // SPOT_EVERY + 1
    assert not checked.disagreed
