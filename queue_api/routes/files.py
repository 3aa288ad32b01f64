"""``/v1/files``: OpenAI's Files API for batch input, output and error files."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import Response, StreamingResponse

from backfill import batches
from backfill.refusals import PayloadTooLarge
from queue_api.deps import RepositoryDep, SettingsDep, TenantDep
from queue_api.schemas import FileDeleted, FileList, FileObject

router = APIRouter(prefix="/v1/files", tags=["files"])

MAX_LIST = 10_000


@router.post("")
def upload_file(
    tenant: TenantDep,
    repo: RepositoryDep,
    settings: SettingsDep,
    file: Annotated[UploadFile, File()],
    purpose: Annotated[str, Form()],
) -> FileObject:
    # One byte over the limit is enough to refuse; never read an oversized upload whole.
    content = file.file.read(settings.max_file_bytes + 1)
    if len(content) > settings.max_file_bytes:
        raise PayloadTooLarge(
            f"file is larger than the limit of {settings.max_file_bytes} bytes", param="file"
        )
    record = batches.upload_file(
        repo,
        settings,
        tenant.id,
        filename=file.filename or "upload.jsonl",
        purpose=purpose,
        content=content,
    )
    return FileObject.of(record)


@router.get("")
def list_files(
    tenant: TenantDep,
    repo: RepositoryDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = MAX_LIST,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
) -> FileList:
    records = repo.list_files(tenant.id, purpose=purpose, limit=MAX_LIST)
    if order == "asc":
        records.reverse()
    if after is not None:
        ids = [r.id for r in records]
        records = records[ids.index(after) + 1 :] if after in ids else []
    page = records[:limit]
    data = [FileObject.of(r) for r in page]
    return FileList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=len(records) > limit,
    )


@router.get("/{file_id}")
def retrieve_file(file_id: str, tenant: TenantDep, repo: RepositoryDep) -> FileObject:
    return FileObject.of(repo.get_file(tenant.id, file_id))


@router.get("/{file_id}/content", response_model=None)
def file_content(file_id: str, tenant: TenantDep, repo: RepositoryDep) -> Response:
    content = batches.file_content(repo, tenant.id, file_id)
    if isinstance(content, bytes):
        return Response(content, media_type="application/octet-stream")
    return StreamingResponse(content, media_type="application/jsonl")


@router.delete("/{file_id}")
def delete_file(file_id: str, tenant: TenantDep, repo: RepositoryDep) -> FileDeleted:
    repo.delete_file(tenant.id, file_id)
    return FileDeleted(id=file_id)
