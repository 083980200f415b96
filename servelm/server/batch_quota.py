"""Per-tenant quotas on what the Files and Batches APIs store: files, their bytes, and
batches not yet finished, each counted per tenant across every replica sharing the store.

Owns: who a request counts against (`tenant_of`) and the checks before an upload or a batch
is stored, refused with an OpenAI-shaped 429 that names the limit, its flag and the tenant.

The tenant: the `OpenAI-Project` header when a client sends one (the openai client's
`project=`), else the API key it authenticated with (as `key:` and a hash: the key itself is
never stored), else `anonymous`. servelm checks one `--api-key`, so clients sharing it are
told apart by their project; the quotas share the server fairly among cooperating
projects, they are not a security boundary between them (a client may name any project).
Were several keys accepted, each key would be a tenant as it is.
Never: stores anything (the endpoints do, with the tenant), or counts a runner's output
files (a batch's output and error files count against no one).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from starlette.requests import Request

from servelm.server.errors import APIError

PROJECT_HEADER = "openai-project"
_MAX_PROJECT_LEN = 128


@dataclass(frozen=True)
class TenantQuota:
    """Per tenant, at most; 0: no limit."""

    max_files: int = 1000  # uploaded files not deleted
    max_file_bytes: int = 10 * 2**30  # their bytes together
    max_active_batches: int = 20  # batches not yet completed, failed, expired or cancelled

    def __post_init__(self):
        for name in ("max_files", "max_file_bytes", "max_active_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"--quota-{name[4:].replace('_', '-')} must be an integer "
                                 f">= 0 (0: no limit), got {value!r}")


def tenant_of(request: Request) -> str:
    """Who the request counts against (the module's docstring says how it is chosen)."""
    project = request.headers.get(PROJECT_HEADER)
    if project is not None:
        project = project.strip()
        if not project or len(project) > _MAX_PROJECT_LEN:
            raise APIError(400, f"the OpenAI-Project header must be 1 to {_MAX_PROJECT_LEN} "
                           "characters", param="OpenAI-Project", code="invalid_project")
        return f"project:{project}"
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return "key:" + hashlib.sha256(token.strip().encode()).hexdigest()[:16]
    return "anonymous"


def _exceeded(what: str, limit: int, flag: str, tenant: str, param: str | None, code: str,
              advice: str) -> APIError:
    return APIError(429, f"{tenant} {what}, its limit ({flag} {limit}); {advice}",
                    "rate_limit_error", param=param, code=code)


async def check_file(db, quota: TenantQuota, tenant: str, num_bytes: int) -> None:
    """Before an upload of num_bytes is stored (db: AsyncStore.call)."""
    if not (quota.max_files or quota.max_file_bytes):
        return
    usage = await db("tenant_usage", tenant)
    advice = "delete files it no longer needs (DELETE /v1/files/{file_id})"
    if quota.max_files and usage.num_files + 1 > quota.max_files:
        raise _exceeded(f"holds {usage.num_files} files", quota.max_files, "--quota-files",
                        tenant, "file", "file_quota_exceeded", advice)
    if quota.max_file_bytes and usage.num_file_bytes + num_bytes > quota.max_file_bytes:
        raise _exceeded(f"holds {usage.num_file_bytes} bytes of files and this one has "
                        f"{num_bytes}", quota.max_file_bytes, "--quota-file-bytes", tenant,
                        "file", "file_storage_quota_exceeded", advice)


async def check_batch(db, quota: TenantQuota, tenant: str) -> None:
    """Before a batch is created."""
    if not quota.max_active_batches:
        return
    usage = await db("tenant_usage", tenant)
    if usage.num_active_batches >= quota.max_active_batches:
        raise _exceeded(f"has {usage.num_active_batches} batches not yet finished",
                        quota.max_active_batches, "--quota-active-batches", tenant,
                        None, "batch_quota_exceeded",
                        "retry when one has finished, or cancel one")


__all__ = ["PROJECT_HEADER", "TenantQuota", "check_batch", "check_file", "tenant_of"]
