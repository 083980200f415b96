"""The request trace: one JSON object per request, written by `servelm bench serve
--record-requests FILE` and replayed by `servelm sim --trace FILE` (servelm/sim/arrivals.py).

Owns: the format, its writer (trace_line) and its checked reader (read_trace).
Never: draws or sends requests; it lives in bench/ because the benchmark writes it and the
simulator, above the benchmark, reads it.

Trace line (keys; times in seconds from the first request's scheduled send):

    {"arrival_s": 0.0,              when the request was scheduled to be sent
     "num_prompt_tokens": 212,
     "max_tokens": 128,             what was asked for
     "num_output_tokens": 128,      what came back (0 for a failed request)
     "prompt_token_ids": [...],     optional: without them each prompt gets its own ids
     "ttft_s": ..., "tpot_s": ..., "e2e_s": ..., "error": null}   measured, optional

A replayed request asks for num_output_tokens when the request succeeded with some, else for
max_tokens (as `ignore_eos` requests, a simulated request ends exactly there).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple


class TraceError(ValueError):
    """A trace file that cannot be replayed; says which line and key."""


class TraceRequest(NamedTuple):
    arrival_s: float
    prompt_token_ids: list[int] | None
    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int
    measured: dict[str, Any]  # ttft_s, tpot_s, e2e_s, error: whatever the line carried

    @property
    def num_replay_tokens(self) -> int:
        """Output tokens a replay asks for: what came back, or what was asked for when the
        request failed or returned nothing."""
        if self.num_output_tokens > 0 and not self.measured.get("error"):
            return self.num_output_tokens
        return self.max_tokens


def trace_line(arrival_s: float, prompt_token_ids: list[int] | None, max_tokens: int,
               num_output_tokens: int, measured: dict[str, Any] | None = None,
               num_prompt_tokens: int | None = None) -> str:
    """One trace line (the writer's half of the format): the prompt's ids, or (ids None)
    only its length."""
    if prompt_token_ids is None and num_prompt_tokens is None:
        raise ValueError("a trace line needs the prompt's ids or its length")
    doc: dict[str, Any] = {"arrival_s": arrival_s,
                           "num_prompt_tokens": len(prompt_token_ids)
                           if prompt_token_ids is not None else num_prompt_tokens,
                           "max_tokens": max_tokens, "num_output_tokens": num_output_tokens}
    if prompt_token_ids is not None:
        doc["prompt_token_ids"] = list(prompt_token_ids)
    doc.update(measured or {})
    return json.dumps(doc)


def _int_field(doc: dict, key: str, where: str, minimum: int) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(f"{where}: {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _parse_line(doc: Any, where: str) -> TraceRequest:
    if not isinstance(doc, dict):
        raise TraceError(f"{where}: expected a JSON object")
    arrival = doc.get("arrival_s")
    if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) \
            or not 0 <= arrival < math.inf:
        raise TraceError(f"{where}: 'arrival_s' must be a number >= 0, got {arrival!r}")
    ids = doc.get("prompt_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise TraceError(f"{where}: 'prompt_token_ids' must be a non-empty list of "
                             f"token ids")
        num_prompt = len(ids)
        if "num_prompt_tokens" in doc and doc["num_prompt_tokens"] != num_prompt:
            raise TraceError(f"{where}: 'num_prompt_tokens' is {doc['num_prompt_tokens']!r} "
                             f"but 'prompt_token_ids' has {num_prompt}")
    else:
        num_prompt = _int_field(doc, "num_prompt_tokens", where, 1)
    max_tokens = _int_field(doc, "max_tokens", where, 1)
    num_output = _int_field(doc, "num_output_tokens", where, 0) \
        if "num_output_tokens" in doc else max_tokens
    measured = {k: doc[k] for k in ("ttft_s", "tpot_s", "e2e_s", "error") if k in doc}
    return TraceRequest(float(arrival), ids, num_prompt, max_tokens, num_output, measured)


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of a JSONL trace, in file order. Errors name the file and line."""
    out = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"--trace {path} line {n}"
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not JSON ({e})") from None
            out.append(_parse_line(doc, where))
    if not out:
        raise TraceError(f"--trace {path}: no requests in the file")
    return out

__all__ = ["TraceError", "TraceRequest", "read_trace", "trace_line"]
