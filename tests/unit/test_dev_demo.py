"""``backfill dev``'s demo: what it submits, and how its summaries are judged."""

from __future__ import annotations

import json

from backfill.batch_input import InputLimits, ValidatedBatch, validate_batch_input
from backfill.config import Settings
from devkit.dev import DOCS, EMBEDDINGS, SAMPLING, batch_lines, copied_lines, repeated_lines


def test_repeated_lines_counts_lines_and_sentences_a_summary_repeats() -> None:
    assert repeated_lines("A poem about a tyger. It asks who made it.") == 0
    looping = "The Tyger\nThe Tyger.\n\nthe tyger\nA poem. A poem!"
    assert repeated_lines(looping) == 3
    assert repeated_lines("") == 0


def test_copied_lines_counts_summary_lines_taken_word_for_word_from_the_document() -> None:
    doc = "The Tyger\nWilliam Blake\n\nTyger Tyger, burning bright,\nIn the forests of the night;"
    assert copied_lines("The Tyger.\nA poem asking who made the tiger.", doc) == 1
    assert copied_lines("A poem asking who made the tiger.", doc) == 0


def test_every_bundled_document_is_submitted_with_the_demo_sampling() -> None:
    lines = batch_lines(DOCS, "smollm2", 96).decode().splitlines()
    assert len(lines) == len(list(DOCS.glob("*.txt"))) == 26
    for line in lines:
        body = json.loads(line)["body"]
        assert {k: body[k] for k in SAMPLING} == SAMPLING
        assert body["repetition_penalty"] > 1.0
        # A seeded request killed vLLM's CPU engine once its prefill was chunked.
        assert "seed" not in body


def test_an_embedding_model_gets_one_valid_embeddings_line_per_document() -> None:
    # `backfill dev --model tiny-embed` submits the documents' texts for embedding.
    data = batch_lines(DOCS, "tiny-embed", 96, EMBEDDINGS)
    checked = validate_batch_input(data, EMBEDDINGS, InputLimits.from_settings(Settings()))
    assert isinstance(checked, ValidatedBatch), checked
    assert len(checked.items) == 26
    assert all(json.loads(i.body)["input"] for i in checked.items)
    assert all(i.max_output_tokens == 0 for i in checked.items)
