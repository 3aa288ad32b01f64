"""Readers of a folder, JSONL, CSV and Parquet: a document per good row, a recorded error
per odd row, a clear refusal for a source that cannot be read at all."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from backfill.summarize.documents import Document, RowError, SourceInvalid
from backfill.summarize.folder import html_text, read_folder
from backfill.summarize.tables import read_table

NOT_UTF8 = "café".encode("latin-1")


def errors(rows):
    return {row.row: row.error for row in rows if isinstance(row, RowError)}


def documents(rows):
    return [(row.id, row.text) for row in rows if isinstance(row, Document)]


# --- a folder -----------------------------------------------------------------------------


def test_a_folder_yields_its_text_markdown_and_html_files_by_path(tmp_path):
    (tmp_path / "b.txt").write_text("Plain text.\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.md").write_text("# Title\n\nBody.\n")
    (tmp_path / "c.html").write_text(
        "<html><head><title>T</title><style>p{}</style></head>"
        "<body><p>First para.</p><script>var x=1;</script><p>Second &amp; last.</p></body></html>"
    )
    (tmp_path / ".hidden.txt").write_text("not read")
    rows = list(read_folder(tmp_path))
    assert documents(rows) == [
        ("b.txt", "Plain text.\n"),
        ("c.html", "First para.\n\nSecond & last."),
        ("sub/a.md", "# Title\n\nBody.\n"),
    ]


def test_a_folder_records_odd_files_and_goes_on(tmp_path):
    (tmp_path / "1-empty.txt").write_text("  \n")
    (tmp_path / "2-latin.txt").write_bytes(NOT_UTF8)
    (tmp_path / "3-report.pdf").write_bytes(b"%PDF")
    (tmp_path / "4-good.txt").write_text("Good.")
    rows = list(read_folder(tmp_path))
    assert errors(rows) == {
        0: "empty text",
        1: "text is not valid UTF-8",
        2: "unsupported file type '.pdf'",
    }
    assert documents(rows) == [("4-good.txt", "Good.")]


def test_html_in_another_declared_encoding_is_read(tmp_path):
    page = '<html><head><meta charset="latin-1"></head><body><p>café</p></body></html>'
    (tmp_path / "p.html").write_bytes(page.encode("latin-1"))
    assert documents(read_folder(tmp_path)) == [("p.html", "café")]


def test_html_text_keeps_blocks_apart():
    assert html_text("<ul><li>one</li><li>two</li></ul>") == "one\ntwo"


def test_a_folder_without_documents_is_refused(tmp_path):
    with pytest.raises(SourceInvalid, match="is not a folder"):
        read_folder(tmp_path / "missing")
    (tmp_path / "x.pdf").write_bytes(b"%PDF")
    with pytest.raises(SourceInvalid, match=r"no \.txt, \.md or \.html"):
        read_folder(tmp_path)


# --- JSONL ----------------------------------------------------------------------------------


def test_jsonl_rows_with_odd_inputs_are_recorded(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [
        json.dumps({"id": "a", "body": "Alpha."}).encode(),
        b"",  # blank: passed over
        json.dumps({"id": "b", "body": ""}).encode(),
        json.dumps({"body": "no id"}).encode(),
        json.dumps({"id": "a", "body": "again"}).encode(),
        b'{"id": "c", "body": "' + NOT_UTF8 + b'"}',
        b"not json",
        b"[1, 2]",
        json.dumps({"id": 7, "body": "Seven."}).encode(),
        json.dumps({"id": "d", "body": 5}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    rows = list(read_table(path, "body", "id"))
    assert documents(rows) == [("a", "Alpha."), ("7", "Seven.")]
    found = errors(rows)
    assert found[2] == "empty text"
    assert found[3] == "missing id"
    assert found[4].startswith("duplicate id 'a'")
    assert found[5] == "line is not valid UTF-8"
    assert found[6].startswith("line is not JSON")
    assert found[7] == "line is not a JSON object"
    assert found[9] == "text must be a string, not int"
    assert 1 not in found


def test_jsonl_without_an_id_column_numbers_its_rows(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"t": "x"}\n{"t": "y"}\n')
    assert documents(read_table(path, "t")) == [("0", "x"), ("1", "y")]


def test_jsonl_whose_first_row_lacks_the_text_column_is_refused(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "x"}\n')
    with pytest.raises(SourceInvalid, match="no 'body' in its first row"):
        read_table(path, "body")


# --- CSV -----------------------------------------------------------------------------------


def test_csv_rows_with_odd_inputs_are_recorded(tmp_path):
    path = tmp_path / "docs.csv"
    long_text = "word " * 60_000  # past the csv module's default field limit
    body = (
        (
            "id,text\n"
            'a,"Line one.\nLine two, quoted."\n'
            "b,\n"
            ",orphan\n"
            "a,again\n"
            f"l,{long_text}\n"
            "short\n"
        ).encode()
        + b"c,"
        + NOT_UTF8
        + b"\n"
    )
    path.write_bytes(body)
    rows = list(read_table(path, "text", "id"))
    assert documents(rows) == [("a", "Line one.\nLine two, quoted."), ("l", long_text)]
    assert errors(rows) == {
        1: "empty text",
        2: "missing id",
        3: "duplicate id 'a': only its first row is summarised",
        5: "missing text",
        6: "text is not valid UTF-8",
    }


def test_csv_without_the_named_columns_is_refused(tmp_path):
    path = tmp_path / "docs.csv"
    path.write_text("id,body\n1,x\n")
    with pytest.raises(SourceInvalid, match="no column 'text'"):
        read_table(path, "text", "id")
    with pytest.raises(SourceInvalid, match="no column 'key'"):
        read_table(path, "body", "key")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(SourceInvalid, match="is empty"):
        read_table(tmp_path / "empty.csv", "text")


# --- Parquet -------------------------------------------------------------------------------


def test_parquet_rows_with_odd_inputs_are_recorded(tmp_path):
    path = tmp_path / "docs.parquet"
    table = pa.table(
        {
            "doc_id": pa.array([1, 2, None, 1, 3], pa.int64()),
            "content": pa.array([b"One.", b"", b"x", b"dup", NOT_UTF8], pa.binary()),
        }
    )
    pq.write_table(table, path)
    rows = list(read_table(path, "content", "doc_id"))
    assert documents(rows) == [("1", "One.")]
    assert errors(rows) == {
        1: "empty text",
        2: "missing id",
        3: "duplicate id '1': only its first row is summarised",
        4: "text is not valid UTF-8",
    }


def test_parquet_without_the_column_or_not_parquet_is_refused(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["a"]}), path)
    with pytest.raises(SourceInvalid, match="no column 'body'"):
        read_table(path, "body")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(SourceInvalid, match="is not a Parquet file"):
        read_table(tmp_path / "bad.parquet", "text")


def test_parquet_is_read_a_batch_at_a_time(tmp_path):
    # Text that does not compress: the file on disk is as large as its text, so a reader that
    # buffers the whole file (pyarrow's ``pre_buffer``, on by default) shows in the pool.
    path = tmp_path / "big.parquet"
    rows, width = 32000, 2000
    rng = random.Random(8)
    with pq.ParquetWriter(path, pa.schema([("id", pa.string()), ("text", pa.string())])) as out:
        for start in range(0, rows, 1000):
            ids = [str(i) for i in range(start, start + 1000)]
            texts = [rng.randbytes(width // 2).hex() for _ in range(1000)]
            out.write_table(pa.table({"id": ids, "text": texts}))
    assert path.stat().st_size > rows * width // 2
    pool = pa.default_memory_pool()
    before = pool.bytes_allocated()
    peak = 0
    count = 0
    for row in read_table(path, "text", "id"):
        assert isinstance(row, Document)
        count += 1
        peak = max(peak, pool.bytes_allocated() - before)
    assert count == rows
    assert peak < (rows * width) // 4  # the file's 64 MB of text are never all in memory


def test_a_table_of_unknown_format_or_missing_is_refused(tmp_path):
    with pytest.raises(SourceInvalid, match="is not a file"):
        read_table(tmp_path / "none.parquet", "text")
    (tmp_path / "docs.xlsx").write_bytes(b"x")
    with pytest.raises(SourceInvalid, match=r"unknown table format '\.xlsx'"):
        read_table(tmp_path / "docs.xlsx", "text")
