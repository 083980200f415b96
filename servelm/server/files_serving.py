"""The Files endpoints (`/v1/files`): upload, list, retrieve, content, delete.

Owns: the File object (OpenAI's shape), the multipart upload (one `file` part and its
`purpose`; a size limit checked from Content-Length before the body is read and again on
the part), the tenant's quota checked before a file is stored (servelm/server/batch_quota.py),
and listing pages.
Never: interprets a file's bytes (a batch's runner reads its input file), or keeps a file
anywhere but the state store.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from servelm.server.batch_quota import TenantQuota, check_file, tenant_of
from servelm.server.errors import APIError

UPLOAD_PURPOSES = ("batch",)  # what a client may upload (batch_output: the runner's files)
_FORM_FIELDS = ("file", "purpose")
_FORM_OVERHEAD = 64 * 1024  # multipart boundaries and headers beside the file's bytes


def file_object(filename: str, purpose: str, num_bytes: int) -> dict[str, Any]:
    """A new File object."""
    return {"id": f"file-{uuid.uuid4().hex}", "object": "file", "bytes": num_bytes,
            "created_at": int(time.time()), "filename": filename, "purpose": purpose,
            "status": "processed", "expires_at": None, "status_details": None}


def _not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id[:80]!r}", param="file_id",
                    code="file_not_found")


def page_params(request: Request, max_limit: int, default_limit: int,
                orders: tuple[str, ...] = ("asc", "desc")) -> tuple[int, str | None, str]:
    """limit, after and order of a list request (400 naming the parameter)."""
    query = request.query_params
    raw = query.get("limit", str(default_limit))
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= max_limit:
        raise APIError(400, f"limit must be an integer from 1 to {max_limit}, got "
                       f"{raw[:16]!r}", param="limit")
    order = query.get("order", "desc")
    if order not in orders:
        raise APIError(400, f"order must be one of {', '.join(orders)}, got {order[:16]!r}",
                       param="order")
    return limit, query.get("after"), order


def list_body(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


class FilesServing:
    def __init__(self, db, max_file_bytes: int, quota: TenantQuota = TenantQuota()):
        self.db = db  # AsyncStore.call
        self.max_file_bytes = max_file_bytes
        self.quota = quota

    async def create(self, request: Request) -> Response:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError(400, "upload a file as multipart/form-data with the parts file "
                           "and purpose", param="file")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() \
                and int(length) > self.max_file_bytes + _FORM_OVERHEAD:
            raise self._too_large()
        tenant = tenant_of(request)
        try:
            form = await request.form(max_files=1, max_fields=len(_FORM_FIELDS))
        except Exception as exc:  # the multipart parser's errors are about this body
            raise APIError(400, f"the upload is not valid multipart/form-data: {exc}",
                           param="file") from None
        try:
            return await self._store(form, tenant)
        finally:
            await form.close()

    async def _store(self, form, tenant: str) -> Response:
        unknown = next((k for k in form.keys() if k not in _FORM_FIELDS), None)
        if unknown is not None:
            raise APIError(400, f"unknown field {unknown[:64]!r}", param=unknown[:64],
                           code="unknown_parameter")
        purpose = form.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(400, f"purpose must be one of {', '.join(UPLOAD_PURPOSES)} on this "
                           f"server, got {str(purpose)[:32]!r}", param="purpose")
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "file is required (a file part)", param="file")
        content = await upload.read(self.max_file_bytes + 1)
        if len(content) > self.max_file_bytes:
            raise self._too_large()
        await check_file(self.db, self.quota, tenant, len(content))
        body = file_object(upload.filename or "upload.jsonl", purpose, len(content))
        await self.db("put_file", body, content, tenant)
        return JSONResponse(body)

    def _too_large(self) -> APIError:
        return APIError(413, f"the file is larger than this server's limit of "
                        f"{self.max_file_bytes} bytes", param="file", code="file_too_large")

    async def list(self, request: Request) -> Response:
        limit, after, order = page_params(request, 10_000, 10_000)
        purpose = request.query_params.get("purpose")
        try:
            page = await self.db("list_files", purpose=purpose, after=after, limit=limit,
                                 order=order)
        except KeyError:
            raise APIError(400, f"after: no file {after[:80]!r}", param="after") from None
        return JSONResponse(list_body(page.items, page.has_more))

    async def retrieve(self, file_id: str) -> Response:
        body = await self.db("get_file", file_id)
        if body is None:
            raise _not_found(file_id)
        return JSONResponse(body)

    async def content(self, file_id: str) -> Response:
        content = await self.db("file_content", file_id)
        if content is None:
            raise _not_found(file_id)
        return Response(content, media_type="application/octet-stream")

    async def delete(self, file_id: str) -> Response:
        if not await self.db("delete_file", file_id):
            raise _not_found(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})


__all__ = ["FilesServing", "file_object", "list_body", "page_params"]
