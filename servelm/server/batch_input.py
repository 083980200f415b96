"""The input file of a batch: JSONL request lines, checked before any line runs.

Owns: `parse_batch_input(content, endpoint, max_lines) -> list[BatchLine]` and the errors of
a malformed file (`BatchInputError`: up to MAX_ERRORS of them, each naming its line and
field, in the Batch object's `errors` shape), the endpoints a batch may name, and
`completion_window` ("24h"; servelm also takes other hours, minutes or seconds).
Never: checks a request body's own fields (that is the endpoint's validation, run per line
when the line runs: a bad body fails its line in the error file, not the batch), or touches
the store.

As OpenAI does, a file whose lines are not requests fails the batch at validation; a line
whose request is refused fails alone.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                   "/v1/responses")
MAX_ERRORS = 100  # errors listed in a failed batch's `errors` (the rest are not read)
_LINE_FIELDS = ("custom_id", "method", "url", "body")
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


@dataclass(frozen=True)
class BatchLine:
    line: int  # 1-based line of the input file
    custom_id: str
    body: dict[str, Any]


class BatchInputError(ValueError):
    """A malformed input file: `errors` as the Batch object lists them."""

    def __init__(self, errors: list[dict[str, Any]]):
        super().__init__(errors[0]["message"])
        self.errors = errors


def completion_window_s(window: Any) -> int:
    """Seconds of a completion_window such as "24h" (ValueError naming the field)."""
    match = _WINDOW.match(window) if isinstance(window, str) else None
    if match is None:
        raise ValueError(f"completion_window must be like '24h' (or N followed by h, m or "
                         f"s), got {str(window)[:32]!r}")
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def _error(line: int | None, param: str | None, message: str,
           code: str = "invalid_request") -> dict[str, Any]:
    where = f"line {line}: " if line is not None else ""
    return {"code": code, "message": where + message, "param": param, "line": line}


def _check_line(n: int, obj: Any, endpoint: str, seen: set[str]) -> dict[str, Any] | None:
    """The first error of one parsed line, or None."""
    if not isinstance(obj, dict):
        return _error(n, None, f"must be a JSON object, got {type(obj).__name__}",
                      "invalid_json_line")
    unknown = next((k for k in obj if k not in _LINE_FIELDS), None)
    if unknown is not None:
        return _error(n, str(unknown)[:64], f"unknown field {str(unknown)[:64]!r}; a line "
                      f"has {', '.join(_LINE_FIELDS)}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _error(n, "custom_id", "custom_id must be a non-empty string")
    if custom_id in seen:
        return _error(n, "custom_id", f"custom_id {custom_id[:64]!r} is used by an earlier "
                      "line", "duplicate_custom_id")
    if obj.get("method") != "POST":
        return _error(n, "method", f"method must be 'POST', got {obj.get('method')!r}")
    if obj.get("url") != endpoint:
        return _error(n, "url", f"url must be the batch's endpoint {endpoint!r}, got "
                      f"{str(obj.get('url'))[:64]!r}", "mismatched_endpoint")
    body = obj.get("body")
    if not isinstance(body, dict):
        return _error(n, "body", "body must be a JSON object (the request)")
    for flag in ("stream", "background"):
        if body.get(flag):
            return _error(n, f"body.{flag}", f"body.{flag} cannot be true in a batch line")
    return None


def parse_batch_input(content: bytes, endpoint: str, max_lines: int) -> list[BatchLine]:
    """The request lines of a JSONL file (blank lines skipped); BatchInputError listing
    the bad lines (or a file-level error) when any is malformed."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchInputError([_error(None, None, f"the input file is not UTF-8 (byte "
                                      f"{exc.start})", "invalid_file")]) from None
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) + len(errors) >= max_lines:
            errors.append(_error(None, None, f"the input file has more than {max_lines} "
                                 "requests (this server's limit per batch)",
                                 "too_many_requests"))
            break
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            err = _error(n, None, f"not valid JSON: {exc}", "invalid_json_line")
        else:
            err = _check_line(n, obj, endpoint, seen)
        if err is not None:
            errors.append(err)
            if len(errors) >= MAX_ERRORS:
                break
            continue
        seen.add(obj["custom_id"])
        lines.append(BatchLine(n, obj["custom_id"], obj["body"]))
    if not errors and not lines:
        errors.append(_error(None, None, "the input file holds no request", "empty_file"))
    if errors:
        raise BatchInputError(errors)
    return lines


__all__ = ["BATCH_ENDPOINTS", "BatchInputError", "BatchLine", "completion_window_s",
           "parse_batch_input"]
