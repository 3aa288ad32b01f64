"""A page of files written directly as JSON is the File list the models write, field for field
and in the same order (the openai SDK and every client see no difference)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from backfill.store import FileRecord
from queue_api.schemas import FileList, FileObject, file_list_json

NOW = datetime(2026, 12, 6, 4, 0, 0, 500_000, tzinfo=UTC)


def records() -> list[FileRecord]:
    return [
        FileRecord("file-a", "t1", "batch", "in.jsonl", 1024, None, NOW),
        FileRecord(
            "file-b",
            "t1",
            "batch_output",
            'résumé "quoted"\\\n\t\u2028✓.jsonl',
            0,
            "batch_x",
            NOW - timedelta(days=3),
            NOW + timedelta(days=30),
        ),
        FileRecord("file-c", "t1", "batch", "", 7, None, NOW - timedelta(seconds=1), NOW, 99),
    ]


def by_models(page: list[FileRecord], has_more: bool) -> str:
    data = [FileObject.of(r) for r in page]
    return FileList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    ).model_dump_json()


def test_a_page_written_directly_is_the_models_page_field_for_field_in_order() -> None:
    for page, more in ((records(), True), (records()[:1], False), ([], False)):
        direct = json.loads(file_list_json(page, more))
        modelled = json.loads(by_models(page, more))
        assert direct == modelled
        assert list(direct) == list(modelled)
        for got, want in zip(direct["data"], modelled["data"], strict=True):
            assert list(got) == list(want)
