"""A job's results as a dataset: one row per source document, written as it streams.

Each row carries the document's id, its summary (empty where it failed), the tokens spent on
it over all its map and reduce steps, how many chunks it was split into and how deep its
reduce tree went, and the error that stopped it. The format follows the output's suffix:
Parquet (rows buffered ``BATCH_ROWS`` at a time into row groups), CSV or JSONL (a row at a
time); memory does not grow with the number of rows.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Protocol, Self

if TYPE_CHECKING:
    import pyarrow as pa

BATCH_ROWS = 4096
"""Rows per Parquet row group written."""


class UnknownFormat(ValueError):
    """An output path whose suffix names no format written here."""


@dataclass(frozen=True, slots=True)
class SummaryRow:
    id: str
    summary: str | None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    chunks: int = 1
    """Chunks the document was split into (1: it fit one prompt)."""
    split_depth: int = 0
    """Reduce levels above its chunks (0: not split)."""


COLUMNS = tuple(f.name for f in fields(SummaryRow))
FORMATS = (".parquet", ".csv", ".jsonl")


class _Sink(Protocol):
    def write(self, row: SummaryRow) -> None: ...
    def close(self) -> None: ...


def parquet_schema() -> pa.Schema:
    """The results' Parquet schema (Arrow loads only when a Parquet file is written: a CSV
    or JSONL output goes without it)."""
    import pyarrow as pa  # noqa: PLC0415

    return pa.schema(
        [
            ("id", pa.string()),
            ("summary", pa.string()),
            ("error", pa.string()),
            ("prompt_tokens", pa.int64()),
            ("completion_tokens", pa.int64()),
            ("chunks", pa.int32()),
            ("split_depth", pa.int32()),
        ]
    )


class _ParquetSink:
    def __init__(self, path: Path) -> None:
        import pyarrow.parquet as pq  # noqa: PLC0415

        self._schema = parquet_schema()
        self._writer = pq.ParquetWriter(path, self._schema)
        self._pending: list[SummaryRow] = []

    def write(self, row: SummaryRow) -> None:
        self._pending.append(row)
        if len(self._pending) >= BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa  # noqa: PLC0415

        if self._pending:
            columns = {name: [getattr(r, name) for r in self._pending] for name in COLUMNS}
            self._writer.write_table(pa.Table.from_pydict(columns, schema=self._schema))
            self._pending = []

    def close(self) -> None:
        self._flush()
        self._writer.close()


class _CsvSink:
    def __init__(self, path: Path) -> None:
        self._handle: IO[str] = path.open("w", encoding="utf-8", newline="")
        self._writer = csv.writer(self._handle)
        self._writer.writerow(COLUMNS)

    def write(self, row: SummaryRow) -> None:
        self._writer.writerow(["" if v is None else v for v in (getattr(row, c) for c in COLUMNS)])

    def close(self) -> None:
        self._handle.close()


class _JsonlSink:
    def __init__(self, path: Path) -> None:
        self._handle: IO[str] = path.open("w", encoding="utf-8")

    def write(self, row: SummaryRow) -> None:
        self._handle.write(json.dumps(asdict(row), ensure_ascii=False) + "\n")

    def close(self) -> None:
        self._handle.close()


def _sink(path: Path) -> _Sink:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _ParquetSink(path)
    if suffix == ".csv":
        return _CsvSink(path)
    if suffix == ".jsonl":
        return _JsonlSink(path)
    raise UnknownFormat(
        f"{path}: cannot write results as {suffix or '(no suffix)'!r}; "
        f"name a file ending in {', '.join(FORMATS)}"
    )


class ResultsWriter:
    """Rows written to ``path`` in the format of its suffix; close it (or use ``with``) to
    finish the file. Opening an unknown suffix raises :class:`UnknownFormat` before any
    file is made."""

    def __init__(self, path: Path) -> None:
        self._sink = _sink(path)
        self.rows = 0

    def write(self, row: SummaryRow) -> None:
        self._sink.write(row)
        self.rows += 1

    def write_all(self, rows: Iterable[SummaryRow]) -> int:
        for row in rows:
            self.write(row)
        return self.rows

    def close(self) -> None:
        self._sink.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def row_from_record(record: dict[str, Any]) -> SummaryRow:
    """A row from its JSON form (what the API's results endpoint sends)."""
    return SummaryRow(**{name: record[name] for name in COLUMNS if name in record})
