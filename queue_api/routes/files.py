"""``/v1/files``: OpenAI's Files API for batch input, output and error files."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import Response, StreamingResponse

from backfill import batches
from queue_api.deps import IngestSlotsDep, RepositoryDep, SettingsDep, TenantDep
from queue_api.edge import FILES_PAGE_MAX
from queue_api.schemas import FileDeleted, FileList, FileObject, file_page_json

router = APIRouter(prefix="/v1/files", tags=["files"])

MAX_LIST = FILES_PAGE_MAX
"""OpenAI's default page; the edge charges a page's rate tokens by its size."""


@router.post("")
def upload_file(
    tenant: TenantDep,
    repo: RepositoryDep,
    settings: SettingsDep,
    slots: IngestSlotsDep,
    file: Annotated[UploadFile, File()],
    purpose: Annotated[str, Form()],
    expires_anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
    expires_seconds: Annotated[str | None, Form(alias="expires_after[seconds]")] = None,
) -> FileObject:
    # The server spooled the upload (to disk past 1 MB; the request edge capped its size):
    # it is checked and stored from there a piece at a time, never read whole.
    with slots.held(tenant.id):
        record = batches.upload_file(
            repo,
            settings,
            tenant.id,
            filename=file.filename or "upload.jsonl",
            purpose=purpose,
            expires_after=None
            if expires_anchor is None and expires_seconds is None
            else {"anchor": expires_anchor, "seconds": expires_seconds},
            content=file.file,
        )
    return FileObject.of(record)


@router.get("", response_model=FileList)
def list_files(
    tenant: TenantDep,
    repo: RepositoryDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = MAX_LIST,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
) -> Response:
    page = repo.files.list_files_page(
        tenant.id, purpose=purpose, limit=limit, after=after, ascending=order == "asc"
    )
    # Written by Postgres, not through the models here: OpenAI's default page is 10,000 files,
    # and a page built in this process held its one interpreter 80-160 ms.
    return Response(file_page_json(page), media_type="application/json")


@router.get("/{file_id}")
def retrieve_file(file_id: str, tenant: TenantDep, repo: RepositoryDep) -> FileObject:
    return FileObject.of(repo.files.get_file(tenant.id, file_id))


@router.get("/{file_id}/content", response_model=None)
def file_content(file_id: str, tenant: TenantDep, repo: RepositoryDep) -> StreamingResponse:
    # Streamed piece by piece (a sync iterator: Starlette reads it in a worker thread).
    record = repo.files.get_file(tenant.id, file_id)
    media_type = "application/octet-stream" if record.job_id is None else "application/jsonl"
    return StreamingResponse(
        batches.file_content(repo, tenant.id, file_id),
        media_type=media_type,
        headers={"Content-Length": str(record.size_bytes)} if record.job_id is None else None,
    )


@router.delete("/{file_id}")
def delete_file(file_id: str, tenant: TenantDep, repo: RepositoryDep) -> FileDeleted:
    repo.files.delete_file(tenant.id, file_id)
    return FileDeleted(id=file_id)
