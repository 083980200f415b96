"""Arrivals beyond `servelm bench serve`'s: gamma-bursty gaps, and the prompts of a recorded
request trace's replay.

Owns: gamma_offsets (gaps with a chosen mean and coefficient of variation) and trace_prompts
(each replayed request's prompt ids). The trace format itself (one JSON object per line,
as `servelm bench serve --record-requests FILE` writes it, and its reader) is
servelm/bench/request_trace.py's: the benchmark writes it and sits below the simulator.
Never: decides what a replica does with a request; sends traffic anywhere.

Gamma: gaps ~ Gamma(shape k = 1 / cv^2, scale = cv^2 / rate), so the mean gap is 1 / rate
and the gaps' coefficient of variation (std / mean) is cv. cv = 1 is Poisson; cv > 1 is
bursty (many short gaps, a few long ones); cv < 1 is smoother than Poisson.
"""

from __future__ import annotations

import math

import numpy as np

from servelm.bench.request_trace import TraceError, TraceRequest
from servelm.bench.workloads import SPECIAL_MARGIN


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


__all__ = ["gamma_offsets", "trace_prompts"]
