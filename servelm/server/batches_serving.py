"""The Batches endpoints (`/v1/batches`): create, retrieve, cancel, list.

Owns: the Batch object as created (OpenAI's shape, status validating, its window's
expires_at), the checks of a create request (input file, endpoint, completion_window,
metadata, the limit on batches not yet finished, the tenant's quota:
servelm/server/batch_quota.py), and cancel (validating or in_progress ->
cancelling; the runner holding the batch aborts its lines and ends it cancelled).
Never: runs a line (servelm/server/batch_runner.py does, on whichever replica holds the
batch), or keeps a batch anywhere but the state store.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from servelm.server.batch_input import BATCH_ENDPOINTS, completion_window_s
from servelm.server.batch_quota import TenantQuota, check_batch, tenant_of
from servelm.server.errors import APIError, read_json_object
from servelm.server.files_serving import list_body, page_params

_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata")
_CANCELLABLE = ("validating", "in_progress")


def _not_found(batch_id: str) -> APIError:
    return APIError(404, f"No batch found with id {batch_id[:80]!r}", param="batch_id",
                    code="batch_not_found")


def _check_metadata(metadata: Any) -> None:
    """OpenAI's metadata: up to 16 string keys (64 chars) with string values (512)."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise APIError(400, "metadata must be an object of at most 16 keys", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise APIError(400, f"metadata[{key[:64]!r}]: keys are at most 64 characters and "
                           "values strings of at most 512", param="metadata")


class BatchesServing:
    def __init__(self, db, runner, model: str, max_body_bytes: int, max_active_batches: int,
                 quota: TenantQuota = TenantQuota()):
        self.db = db  # AsyncStore.call
        self.runner = runner  # BatchRunner: woken when a batch is created or cancelled
        self.model = model
        self.max_body_bytes = max_body_bytes
        self.max_active_batches = max_active_batches
        self.quota = quota

    async def create(self, request: Request) -> Response:
        tenant = tenant_of(request)
        body = await read_json_object(request, self.max_body_bytes)
        unknown = next((k for k in body if k not in _FIELDS), None)
        if unknown is not None:
            raise APIError(400, f"{unknown[:64]} is not a Batches API field this server "
                           "supports", param=unknown[:64], code="unknown_parameter")
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name), str) or not body[name]:
                raise APIError(400, f"{name} is required (a string)", param=name)
        if body["endpoint"] not in BATCH_ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got "
                           f"{body['endpoint'][:64]!r}", param="endpoint")
        try:
            window_s = completion_window_s(body["completion_window"])
        except ValueError as exc:
            raise APIError(400, str(exc), param="completion_window") from None
        _check_metadata(body.get("metadata"))
        await self._check_input_file(body["input_file_id"])
        if await self.db("num_active_batches") >= self.max_active_batches:
            raise APIError(429, f"this server runs at most {self.max_active_batches} batches "
                           "at once; retry when one has finished", "rate_limit_error",
                           code="batch_limit_reached", headers={"Retry-After": "60"})
        await check_batch(self.db, self.quota, tenant)
        batch = self._new(body, window_s)
        await self.db("put_batch", batch, tenant)
        self.runner.wake()
        return JSONResponse(batch)

    async def _check_input_file(self, file_id: str) -> None:
        meta = await self.db("get_file", file_id)
        if meta is None:
            raise APIError(400, f"input_file_id: no file {file_id[:80]!r}",
                           param="input_file_id", code="file_not_found")
        if meta["purpose"] != "batch":
            raise APIError(400, f"input_file_id: file {file_id[:80]!r} has purpose "
                           f"{meta['purpose']!r}, not 'batch'", param="input_file_id")

    def _new(self, body: dict[str, Any], window_s: int) -> dict[str, Any]:
        now = int(time.time())
        return {"id": f"batch_{uuid.uuid4().hex}", "object": "batch",
                "endpoint": body["endpoint"], "model": self.model, "errors": None,
                "input_file_id": body["input_file_id"],
                "completion_window": body["completion_window"], "status": "validating",
                "output_file_id": None, "error_file_id": None, "created_at": now,
                "in_progress_at": None, "expires_at": now + window_s, "finalizing_at": None,
                "completed_at": None, "failed_at": None, "expired_at": None,
                "cancelling_at": None, "cancelled_at": None,
                "request_counts": {"total": 0, "completed": 0, "failed": 0},
                "metadata": body.get("metadata"), "usage": None}

    async def retrieve(self, batch_id: str) -> Response:
        body = await self.db("get_batch", batch_id)
        if body is None:
            raise _not_found(batch_id)
        return JSONResponse(body)

    async def cancel(self, batch_id: str) -> Response:
        """validating / in_progress -> cancelling; cancelling or cancelled as they are; a
        finished batch is a 409."""
        while True:
            body = await self.db("get_batch", batch_id)
            if body is None:
                raise _not_found(batch_id)
            if body["status"] in ("cancelling", "cancelled"):
                return JSONResponse(body)
            if body["status"] not in _CANCELLABLE:
                raise APIError(409, f"Cannot cancel a batch with status {body['status']!r}",
                               param="batch_id", code="batch_not_cancellable")
            body = dict(body, status="cancelling", cancelling_at=int(time.time()))
            if await self.db("update_batch", body, only_if_status=_CANCELLABLE):
                self.runner.wake()  # nobody holds it: a runner claims it and ends it
                return JSONResponse(body)
            # it moved on meanwhile (validated, or finished): look again

    async def list(self, request: Request) -> Response:
        limit, after, _ = page_params(request, 100, 20, orders=("desc",))
        try:
            page = await self.db("list_batches", after=after, limit=limit)
        except KeyError:
            raise APIError(400, f"after: no batch {after[:80]!r}", param="after") from None
        return JSONResponse(list_body(page.items, page.has_more))


__all__ = ["BatchesServing"]
