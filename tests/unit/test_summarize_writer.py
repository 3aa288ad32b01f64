"""Results written as a dataset: the same rows read back from Parquet, CSV and JSONL."""

from __future__ import annotations

import csv
import json

import pyarrow.parquet as pq
import pytest

from backfill.summarize import writer
from backfill.summarize.writer import ResultsWriter, SummaryRow, UnknownFormat, row_from_record

ROWS = [
    SummaryRow("a", "A short summary.", None, 120, 30, 1, 0),
    SummaryRow('long, "quoted"\nid', "Résumé, deux niveaux.", None, 9000, 700, 12, 2),
    SummaryRow("c", None, "context_length_exceeded: too long", 0, 0, 1, 0),
]


def test_parquet_results_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "BATCH_ROWS", 2)  # more than one row group
    path = tmp_path / "out.parquet"
    with ResultsWriter(path) as out:
        assert out.write_all(ROWS) == 3
    parquet = pq.ParquetFile(path)
    assert parquet.metadata.num_row_groups == 2
    assert [row_from_record(r) for r in parquet.read().to_pylist()] == ROWS


def test_jsonl_results_read_back(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultsWriter(path) as out:
        out.write_all(ROWS)
    back = [row_from_record(json.loads(line)) for line in path.read_text().splitlines()]
    assert back == ROWS


def test_csv_results_read_back_with_empty_cells_for_none(tmp_path):
    path = tmp_path / "out.csv"
    with ResultsWriter(path) as out:
        out.write_all(ROWS)
    with path.open(newline="") as handle:
        records = list(csv.DictReader(handle))
    assert [r["id"] for r in records] == [r.id for r in ROWS]
    assert records[2]["summary"] == ""
    assert records[2]["error"] == "context_length_exceeded: too long"
    assert records[1]["split_depth"] == "2"
    assert list(records[0]) == list(writer.COLUMNS)


def test_an_unknown_suffix_is_refused_before_a_file_is_made(tmp_path):
    with pytest.raises(UnknownFormat, match=r"\.parquet, \.csv, \.jsonl"):
        ResultsWriter(tmp_path / "out.xlsx")
    assert not (tmp_path / "out.xlsx").exists()
