"""Arrivals beyond `servelm bench serve`'s: gamma-bursty gaps, and the replay of a recorded
request trace.

Owns: gamma_offsets (gaps with a chosen mean and coefficient of variation), the trace format
(one JSON object per line, as `servelm bench serve --record-requests FILE` writes it) and
reading it into SimRequests.
Never: decides what a replica does with a request; sends traffic anywhere.

Gamma: gaps ~ Gamma(shape k = 1 / cv^2, scale = cv^2 / rate), so the mean gap is 1 / rate
and the gaps' coefficient of variation (std / mean) is cv. cv = 1 is Poisson; cv > 1 is
bursty (many short gaps, a few long ones); cv < 1 is smoother than Poisson.

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

import numpy as np

from servelm.bench.workloads import SPECIAL_MARGIN


class TraceError(ValueError):
    """A trace file that cannot be replayed; says which line and key."""


def gamma_offsets(num: int, rate: float, cv: float, seed: int = 0) -> np.ndarray:
    """Send times (s) of `num` requests at a mean of `rate` per second with gamma gaps whose
    coefficient of variation is `cv`. The first request goes at 0, as bench serve's do."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if not 0 < rate < math.inf:
        raise ValueError(f"--request-rate must be positive and finite for gamma arrivals, "
                         f"got {rate}")
    if not 0 < cv < math.inf:
        raise ValueError(f"--burstiness must be positive and finite, got {cv}")
    if num == 0:
        return np.zeros(0)
    shape = 1.0 / (cv * cv)
    gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps)


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


def trace_prompts(trace: list[TraceRequest], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Each request's prompt: its recorded ids, or (without them) seeded random ids of its
    length, drawn like bench serve's random workload, so no two prompts share a prefix."""
    rng = np.random.default_rng(seed)
    prompts = []
    for t in trace:
        if t.prompt_token_ids is not None:
            bad = next((x for x in t.prompt_token_ids if x >= vocab_size), None)
            if bad is not None:
                raise TraceError(f"--trace: prompt token id {bad} is outside --vocab-size "
                                 f"{vocab_size}")
            prompts.append(list(t.prompt_token_ids))
        else:
            ids = rng.integers(SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN,
                               size=t.num_prompt_tokens)
            prompts.append([int(x) for x in ids])
    return prompts


__all__ = ["TraceError", "TraceRequest", "gamma_offsets", "read_trace", "trace_line",
           "trace_prompts"]
