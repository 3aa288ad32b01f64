"""``backfill dev``'s demo: what it submits, and how its summaries are judged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backfill.batch_input import InputLimits, ValidatedBatch, validate_batch_input
from backfill.config import Settings
from devkit.demo_job import (
    DOCS,
    EMBEDDINGS,
    SAMPLING,
    batch_lines,
    copied_lines,
    demo_sampling,
    repeated_lines,
)
from devkit.dev import activation
from devkit.dev_summary import WHOLE_COLLECTION, demo_documents, document_lines


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


def test_the_demo_job_sends_every_bundled_document_and_then_all_of_them_as_one() -> None:
    documents = demo_documents(DOCS)
    assert len(documents) == len(list(DOCS.glob("*.txt"))) + 1 == 27
    last_id, whole = documents[-1]
    assert last_id == WHOLE_COLLECTION
    for doc_id, text in documents[:-1]:
        assert doc_id in whole
        assert text in whole
    # Longer than the demo models' 2,048-token context at 7 bytes of English a token (their
    # tokenizer's run 4 to 5): the server must split and reduce it (test_dev_command sees it).
    assert len(whole.encode()) > 7 * 2048
    lines = [json.loads(line) for line in document_lines(documents).decode().splitlines()]
    assert [(row["id"], row["text"]) for row in lines] == documents


def test_a_folder_without_documents_is_refused() -> None:
    with pytest.raises(SystemExit, match=r"no \.txt documents"):
        demo_documents(Path(__file__).parent / "no-such-folder")


def test_the_demo_job_samples_smollm2_greedily_and_the_random_tiny_model_as_its_engine_does():
    assert demo_sampling("smollm2") == SAMPLING
    assert demo_sampling("tiny") == {}


def test_what_dev_prints_for_the_cli_activates_the_venv_the_shell_lacks(tmp_path: Path) -> None:
    """scripts/demo.sh runs `backfill` from .venv; the newcomer's shell has not activated
    it, so the printed `backfill status ...` needs the activation before it."""
    venv_bin = tmp_path / ".venv" / "bin"
    assert activation(venv_bin, True, None) == f"source {venv_bin / 'activate'}; "
    assert activation(venv_bin, True, "/usr/bin/backfill").startswith("source ")
    assert activation(venv_bin, True, str(venv_bin / "backfill")) == ""
    assert activation(Path("/usr/bin"), False, None) == ""
