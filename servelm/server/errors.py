"""Errors over HTTP in the OpenAI shape, and the request-body checks that produce most of them.

Owns: APIError (status + OpenAI error fields), the JSON error response, reading a request body
within a size limit and turning it into a JSON object (content type, UTF-8, lone surrogates,
malformed JSON, non-object bodies), and mapping pydantic errors to one named parameter.
Never: lets bad input become a 5xx.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from servelm.protocol import InvalidParameterError


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def from_invalid(cls, exc: InvalidParameterError) -> "APIError":
        if exc.code == "slo_unattainable":  # the SLO policy's early refusal: retry later
            return cls(429, str(exc), "rate_limit_error", exc.param, exc.code,
                       headers={"Retry-After": "1"})
        if exc.code == "model_not_found":
            return cls(404, str(exc), "invalid_request_error", exc.param or "model",
                       "model_not_found")
        return cls(400, str(exc), "invalid_request_error", exc.param, exc.code)

    @classmethod
    def from_validation(cls, exc: ValidationError) -> "APIError":
        errors = exc.errors(include_url=False)
        loc = [x for x in errors[0].get("loc", ()) if not _UNION_TAG.match(str(x))]
        param = str(loc[0]) if loc else None
        where = ".".join(str(x) for x in loc) or "body"
        same_field = [e for e in errors if e.get("loc", ())[:1] == errors[0].get("loc", ())[:1]]
        if len(same_field) > 1:  # a union: say what was expected rather than the last try
            tried = sorted({str(e["loc"][1]) for e in same_field if len(e.get("loc", ())) > 1})
            msg = f"has the wrong type or value (expected one of: {', '.join(tried)})"
        else:
            msg = errors[0].get("msg", "invalid value")
        return cls(400, f"{where}: {msg}", param=param)


# pydantic names the member of a union that failed ("str", "list[int]") in an error's loc.
_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\])$")


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return APIError(status, message, type, param, code, headers).response()


def _check_content_type(request: Request) -> None:
    ctype = request.headers.get("content-type")
    if ctype is None:
        return  # lenient, as FastAPI: no content type is read as JSON
    media, _, params = ctype.partition(";")
    if media.strip().lower() != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {media.strip()!r}",
                       param=None, code="unsupported_media_type")
    for p in params.split(";"):
        key, _, value = p.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
                "utf-8", "utf8"):
            raise APIError(415, f"charset must be utf-8, got {value.strip()!r}",
                           code="unsupported_media_type")


async def _read_limited(request: Request, max_bytes: int) -> bytes:
    too_big = APIError(413, f"request body exceeds {max_bytes} bytes",
                       code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None:
        try:
            if int(length) > max_bytes:
                raise too_big
        except ValueError:
            raise APIError(400, "invalid Content-Length header") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object, or an APIError with a 4xx status."""
    _check_content_type(request)
    raw = await _read_limited(request, max_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8 (byte {exc.start})",
                       code="invalid_utf8") from None
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}",
                       code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(obj).__name__}",
                       code="invalid_json")
    try:
        # "\ud800" escapes decode to lone surrogates, which no tokenizer can take.
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "request body contains a lone UTF-16 surrogate (invalid Unicode)",
                       code="invalid_unicode") from None
    return obj
