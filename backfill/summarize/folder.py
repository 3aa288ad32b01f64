"""A folder of documents: ``.txt``, ``.md`` and ``.html`` files, one document each.

Files are read one at a time in the sorted order of their paths below the folder (subfolders
included), and each file's path relative to the folder is its id. Markdown is summarised as
written (its markup is text a model reads well); HTML is reduced to its visible text by
BeautifulSoup, which also honours a page's declared encoding. Hidden files and folders (a
leading dot) are passed over; any other file is recorded as a row error, so a stray PDF shows
up in the results instead of vanishing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from backfill.summarize.documents import RowError, RowGate, SourceInvalid, SourceRow, decode_utf8

TEXT_SUFFIXES = frozenset({".txt", ".md", ".markdown"})
HTML_SUFFIXES = frozenset({".html", ".htm"})
SUFFIXES = TEXT_SUFFIXES | HTML_SUFFIXES
MAX_FILE_BYTES = 64 * 1024 * 1024
"""Largest document file read: one file is held in memory while it is read."""

# Elements whose text a reader never sees.
_INVISIBLE = ("script", "style", "noscript", "template", "head")
# Elements that stand apart as paragraphs, and those that end a line.
_BLOCKS = (
    "p",
    "div",
    "section",
    "article",
    "header",
    "footer",
    "main",
    "aside",
    "nav",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "ul",
    "ol",
    "dl",
    "table",
    "blockquote",
    "pre",
    "figure",
    "hr",
)
_LINES = ("li", "tr", "dt", "dd", "br", "figcaption", "caption")
_SPACE = re.compile(r"\s+")
_BLANK_RUNS = re.compile(r"\n{3,}")


def html_text(data: bytes | str) -> str:
    """The visible text of an HTML page: space inside text collapsed as a browser shows it
    (not inside ``<pre>``), each block a paragraph of its own, each list item or table row a
    line (the paragraph and line breaks the splitter cuts at)."""
    # BeautifulSoup loads with the first HTML file: a folder of text, or a table, starts
    # without it (~50 ms).
    from bs4 import BeautifulSoup  # noqa: PLC0415

    soup = BeautifulSoup(data, "html.parser")
    for element in soup(_INVISIBLE):
        element.decompose()
    for string in soup.find_all(string=True):
        if string.find_parent("pre") is None:
            string.replace_with(_SPACE.sub(" ", str(string)))
    for element in soup(_BLOCKS):
        element.insert_before("\n\n")
        element.insert_after("\n\n")
    for element in soup(_LINES):
        element.insert_after("\n")
    lines = (line.strip() for line in soup.get_text("").splitlines())
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()


def _document_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if any(part.startswith(".") for part in relative.parts):
            continue
        if path.is_file():
            yield path


def count_files(root: Path) -> int:
    """Rows :func:`read_folder` gives for ``root`` (a file each, read or not), by listing it."""
    return sum(1 for _ in _document_files(root))


def read_folder(root: Path) -> Iterator[SourceRow]:
    """The documents of the folder ``root``; raises :class:`SourceInvalid` when it is not a
    folder or holds no document file at all (checked before the first row is read)."""
    if not root.is_dir():
        raise SourceInvalid(f"{root} is not a folder")
    if not any(path.suffix.lower() in SUFFIXES for path in _document_files(root)):
        raise SourceInvalid(
            f"{root} holds no .txt, .md or .html files: give a folder of documents, or a "
            "JSONL, CSV or Parquet file with --text-column"
        )
    return _read_files(root)


def _read_files(root: Path) -> Iterator[SourceRow]:
    gate = RowGate()
    for row, path in enumerate(_document_files(root)):
        doc_id = path.relative_to(root).as_posix()
        suffix = path.suffix.lower()
        if suffix not in SUFFIXES:
            yield RowError(row, doc_id, f"unsupported file type {suffix or '(none)'!r}")
            continue
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            yield RowError(row, doc_id, f"file of {size} bytes is over {MAX_FILE_BYTES}")
            continue
        data = path.read_bytes()
        text: str | None = html_text(data) if suffix in HTML_SUFFIXES else decode_utf8(data)
        if text is None:
            yield RowError(row, doc_id, "text is not valid UTF-8")
            continue
        yield gate.admit(row, doc_id, text)
