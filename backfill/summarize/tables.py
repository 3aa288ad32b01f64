"""Documents kept as rows of a table: a JSONL, CSV or Parquet file with a text column and,
optionally, an id column (without one, a row's position is its id).

Every reader streams: JSONL and CSV a line at a time, Parquet a record batch at a time, so
memory follows the longest row (or a batch of rows), not the file. What makes the file
unreadable raises :class:`SourceInvalid` before the first row: no such file, a format not
known from its suffix, a header or schema without the named columns. A row that cannot be a
document (not JSON, no text, bytes that are not UTF-8, a repeated id) is a
:class:`RowError` and reading goes on.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backfill.summarize.documents import (
    RowError,
    RowGate,
    SourceInvalid,
    SourceRow,
    decode_utf8,
)

if TYPE_CHECKING:
    import pyarrow.parquet as pq

JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
CSV_SUFFIXES = frozenset({".csv"})
PARQUET_SUFFIXES = frozenset({".parquet", ".pq"})
PARQUET_BATCH_ROWS = 1024
"""Rows read from a Parquet file at a time."""
MAX_CSV_FIELD_CHARS = 64 * 1024 * 1024
"""Longest CSV field (the csv module's own default, 128 KiB, is shorter than many documents)."""


def read_table(path: Path, text_column: str, id_column: str | None = None) -> Iterator[SourceRow]:
    """The documents of the table file ``path``, its format known from its suffix."""
    if not path.is_file():
        raise SourceInvalid(f"{path} is not a file")
    if not text_column:
        raise SourceInvalid("a table needs --text-column: the column that holds the text")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return read_jsonl(path, text_column, id_column)
    if suffix in CSV_SUFFIXES:
        return read_csv(path, text_column, id_column)
    if suffix in PARQUET_SUFFIXES:
        return read_parquet(path, text_column, id_column)
    raise SourceInvalid(
        f"{path}: unknown table format {suffix or '(no suffix)'!r}; give .jsonl, .csv or .parquet"
    )


def _row_id(row: int, record: dict[str, Any], id_column: str | None) -> object:
    return str(row) if id_column is None else record.get(id_column)


def table_rows(path: Path) -> int | None:
    """Rows of a Parquet file, from its footer (nothing else is read); None for a format that
    says it only by being read whole (JSONL, CSV), or a file that is not one."""
    if path.suffix.lower() not in PARQUET_SUFFIXES:
        return None
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        return int(pq.ParquetFile(path, pre_buffer=False).metadata.num_rows)
    except (pa.ArrowInvalid, OSError):
        return None


def read_jsonl(path: Path, text_column: str, id_column: str | None) -> Iterator[SourceRow]:
    """One JSON object a line; blank lines are passed over (their numbers still count). The
    first object decides: without ``text_column`` the file is refused (a mistyped name
    should not become a million row errors)."""
    first = _first_jsonl_object(path)
    if first is not None and text_column not in first:
        raise SourceInvalid(
            f"{path}: no {text_column!r} in its first row (it has {_listed(first)})"
        )
    return _jsonl_rows(path, text_column, id_column)


def _first_jsonl_object(path: Path) -> dict[str, Any] | None:
    with path.open("rb") as lines:
        for line in lines:
            text = decode_utf8(line)
            if text is None or not text.strip():
                continue
            try:
                value = json.loads(text)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def _jsonl_rows(path: Path, text_column: str, id_column: str | None) -> Iterator[SourceRow]:
    gate = RowGate()
    with path.open("rb") as lines:
        for row, line in enumerate(lines):
            text = decode_utf8(line)
            if text is None:
                yield RowError(row, None, "line is not valid UTF-8")
                continue
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except ValueError as exc:
                yield RowError(row, None, f"line is not JSON: {exc}")
                continue
            if not isinstance(record, dict):
                yield RowError(row, None, "line is not a JSON object")
                continue
            yield gate.admit(row, _row_id(row, record, id_column), record.get(text_column))


def read_csv(path: Path, text_column: str, id_column: str | None) -> Iterator[SourceRow]:
    """A CSV file with a header row; fields may span lines (quoted). Its header is read at
    once, so a missing column is refused before any row."""
    header = _csv_header(path)
    for name in (text_column, id_column):
        if name is not None and name not in header:
            raise SourceInvalid(f"{path}: no column {name!r} (its header has {_listed(header)})")
    return _csv_rows(path, text_column, id_column)


def _csv_open(path: Path) -> Any:
    # surrogateescape: a field that is not UTF-8 is found and recorded by the row gate, and
    # does not end the file.
    return path.open(encoding="utf-8-sig", errors="surrogateescape", newline="")


def _csv_header(path: Path) -> list[str]:
    with _csv_open(path) as handle:
        try:
            return next(csv.reader(handle))
        except StopIteration:
            raise SourceInvalid(f"{path} is empty: a CSV file starts with a header row") from None
        except csv.Error as exc:
            raise SourceInvalid(f"{path}: its header row is not CSV: {exc}") from None


def _csv_rows(path: Path, text_column: str, id_column: str | None) -> Iterator[SourceRow]:
    csv.field_size_limit(max(csv.field_size_limit(), MAX_CSV_FIELD_CHARS))
    gate = RowGate()
    with _csv_open(path) as handle:
        records = csv.DictReader(handle)
        row = -1
        while True:
            row += 1
            try:
                record = next(records)
            except StopIteration:
                return
            except csv.Error as exc:
                yield RowError(row, None, f"row is not CSV: {exc}")
                continue
            yield gate.admit(row, _row_id(row, record, id_column), record.get(text_column))


def read_parquet(path: Path, text_column: str, id_column: str | None) -> Iterator[SourceRow]:
    """A Parquet file, read ``PARQUET_BATCH_ROWS`` rows at a time and only the columns named;
    a text column of binary type is decoded as UTF-8 row by row."""
    # Arrow loads only for a Parquet file (~120 ms with numpy): JSONL and CSV go without it.
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        # Not ``pre_buffer``: it reads every row group asked for ahead (iter_batches asks
        # for all), so a 1 GiB input held its whole file in memory (client 603 MiB at 1 GiB).
        parquet = pq.ParquetFile(path, pre_buffer=False)
    except (pa.ArrowInvalid, OSError) as exc:
        raise SourceInvalid(f"{path} is not a Parquet file: {exc}") from None
    names = parquet.schema_arrow.names
    for name in (text_column, id_column):
        if name is not None and name not in names:
            raise SourceInvalid(f"{path}: no column {name!r} (it has {_listed(names)})")
    columns = [text_column] if id_column is None else [text_column, id_column]
    return _parquet_rows(parquet, columns, text_column, id_column)


def _parquet_rows(
    parquet: pq.ParquetFile, columns: list[str], text_column: str, id_column: str | None
) -> Iterator[SourceRow]:
    gate = RowGate()
    row = 0
    with parquet:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            texts = batch.column(text_column).to_pylist()
            ids = batch.column(id_column).to_pylist() if id_column is not None else None
            for i, value in enumerate(texts):
                doc_id = str(row) if ids is None else ids[i]
                text = decode_utf8(value) if isinstance(value, bytes) else value
                if isinstance(value, bytes) and text is None:
                    yield RowError(row, _shown(doc_id), "text is not valid UTF-8")
                else:
                    yield gate.admit(row, doc_id, text)
                row += 1


def _shown(doc_id: object) -> str | None:
    return None if doc_id is None else str(doc_id)


def _listed(names: Any) -> str:
    shown = [repr(str(name)) for name in list(names)[:20]]
    return ", ".join(shown) if shown else "no columns"
