"""A long document split into chunks that fit: every character kept, every chunk counted
whole, cuts at the coarsest boundary that serves."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backfill.summarize.chunks import ChunkBudget, ChunkTooSmall, split_counted, split_document

_TOKENS = re.compile(r"\w+|[^\w\s]|\s+")


def word_count(text: str) -> int:
    """Words, punctuation and runs of space each a token, plus a start-of-text token."""
    return 1 + len(_TOKENS.findall(text))


def char_count(text: str) -> int:
    """About four characters a token, as byte-level tokenizers average on English."""
    return math.ceil(len(text.encode()) / 4)


COUNTS = [word_count, char_count]

texts = st.lists(
    st.sampled_from([*"ab cd.\n!?é漢", "\n\n", ". ", "xyzxyzxyz", " \t\n \n"]), max_size=150
).map("".join)


@pytest.mark.parametrize("count", COUNTS)
@settings(max_examples=150, deadline=None)
@given(text=texts, limit=st.integers(min_value=3, max_value=60))
def test_chunks_give_the_document_back_and_each_fits(count, text, limit):
    chunks = split_document(text, limit, count)
    assert "".join(chunks) == text
    if count(text) <= limit:
        assert chunks == [text]
    else:
        assert all(chunk for chunk in chunks)
        assert all(count(chunk) <= limit for chunk in chunks)


@pytest.mark.parametrize("count", COUNTS)
@settings(max_examples=100, deadline=None)
@given(text=texts, limit=st.integers(min_value=3, max_value=60))
def test_each_chunk_comes_with_tokens_it_does_not_exceed(count, text, limit):
    chunks = split_counted(text, limit, count)
    assert "".join(chunk for chunk, _ in chunks) == text
    assert all(count(chunk) <= tokens <= limit for chunk, tokens in chunks)


def test_a_document_that_fits_is_one_chunk():
    assert split_document("short text.", 100, word_count) == ["short text."]


def test_cuts_fall_on_paragraph_breaks_when_paragraphs_fit():
    paragraphs = [f"Paragraph {i} says a few words. It has two sentences." for i in range(9)]
    text = "\n\n".join(paragraphs)
    limit = word_count(paragraphs[0] + "\n\n" + paragraphs[1] + "\n\n") + 3
    chunks = split_document(text, limit, word_count)
    assert len(chunks) > 1
    assert "".join(chunks) == text
    for chunk in chunks[:-1]:
        assert chunk.endswith("\n\n")
        assert chunk.rstrip("\n").endswith("sentences.")


def test_a_paragraph_longer_than_a_chunk_is_cut_at_sentence_ends():
    sentences = [f"Sentence number {i} is here." for i in range(40)]
    text = " ".join(sentences)
    chunks = split_document(text, 30, word_count)
    assert len(chunks) > 1
    assert "".join(chunks) == text
    for chunk in chunks[:-1]:
        assert chunk.endswith("here. ")


def test_a_run_without_spaces_is_cut_between_characters():
    text = "x" * 1000
    chunks = split_document(text, 10, char_count)
    assert "".join(chunks) == text
    assert all(char_count(c) <= 10 for c in chunks)
    assert len(chunks) == 25


def test_counting_is_logarithmic_per_chunk_not_per_character():
    calls = 0

    def counting(text: str) -> int:
        nonlocal calls
        calls += 1
        return word_count(text)

    text = "\n\n".join(f"Paragraph {i}. " + "word " * 30 for i in range(200))
    chunks = split_document(text, 200, counting)
    # One count per paragraph to find the ones that fit, a handful per chunk to pack them.
    assert calls < 200 + 20 * len(chunks)


def test_a_long_document_of_sentences_costs_a_few_counts_per_chunk():
    """Each count is a round trip to the engine's /tokenize while it may sit idle: a sentence
    whose bytes fit is not counted, and a chunk's end is aimed at from the tokens per byte
    seen so far (before: every sentence was counted, then 10-20 counts per chunk)."""
    counted: list[str] = []

    def counting(text: str) -> int:
        counted.append(text)
        return word_count(text)

    text = " ".join(f"Sentence {i} says a few words about the topic at hand." for i in range(600))
    chunks = split_counted(text, 400, counting)
    assert len(chunks) > 5
    assert "".join(chunk for chunk, _ in chunks) == text
    assert all(word_count(chunk) == tokens <= 400 for chunk, tokens in chunks[:-1])
    assert len(counted) == len(set(counted)), "a text counted twice"
    assert len(counted) <= 1 + 3 * len(chunks)


def test_a_count_the_caller_has_is_not_asked_again():
    counted: list[str] = []

    def counting(text: str) -> int:
        counted.append(text)
        return word_count(text)

    text = " ".join(f"Sentence {i} is here." for i in range(100))
    chunks = split_counted(text, 100, counting, tokens=word_count(text))
    assert len(chunks) > 1
    assert text not in counted


def test_a_budget_that_holds_no_character_is_refused():
    with pytest.raises(ChunkTooSmall):
        split_document("abc def", 1, word_count)  # every text counts a start token too
    with pytest.raises(ChunkTooSmall):
        split_document("abc", 0, word_count)


def test_budget_leaves_room_for_the_prompt_and_the_summary():
    budget = ChunkBudget(context_tokens=2048, prompt_tokens=40, summary_tokens=256)
    assert budget.text_tokens == 2048 - 40 - 256 - budget.margin_tokens
    budget.check()
    with pytest.raises(ChunkTooSmall, match="no room"):
        ChunkBudget(context_tokens=300, prompt_tokens=40, summary_tokens=256).check()
