"""``bench.summarize``'s corpus: the share of documents longer than the context, and a
Parquet file the CLI's reader takes row by row."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from backfill.summarize.documents import Document
from backfill.summarize.tables import read_table
from bench.summarize import BYTES_PER_TOKEN, document_lengths, sentences, write_corpus


def test_a_twentieth_of_the_documents_are_longer_than_the_context_the_rest_shorter() -> None:
    lengths = document_lengths(2000, 2048, 0.05, seed=1)
    context_bytes = 2048 * BYTES_PER_TOKEN
    assert len(lengths) == 2000
    assert sum(1 for x in lengths if x > context_bytes) == 100
    assert all(x >= 200 for x in lengths)
    assert document_lengths(2000, 2048, 0.05, seed=1) == lengths  # seeded
    assert sum(1 for x in document_lengths(10, 2048, 0.05, seed=1) if x > context_bytes) == 1


def test_the_corpus_is_a_parquet_of_ids_and_texts_of_the_drawn_lengths(tmp_path: Path) -> None:
    lengths = [300, 5000, 1200]
    path = tmp_path / "corpus.parquet"
    write_corpus(path, lengths, seed=3, rows_per_group=2)
    assert pq.read_metadata(path).num_rows == 3
    rows = list(read_table(path, "text", "id"))
    assert all(isinstance(r, Document) for r in rows)
    docs = [r for r in rows if isinstance(r, Document)]
    assert [d.id for d in docs] == ["doc-0", "doc-1", "doc-2"]
    longest = max(len(s) for s in sentences())
    for doc, size in zip(docs, lengths, strict=True):
        assert size <= len(doc.text) <= size + longest + 1
