"""`servelm plan prefill`: prompt processing time, the TTFT budget, and the stall a long
prompt imposes on running decodes unless it is chunked.

Owns: prefill time at an MFU (with and without attention FLOPs, floored by one read of the
weights), tokens that fit a TTFT budget (a quadratic in prompt length), the unchunked stall,
and the largest chunk that keeps a mixed decode+prefill step under a TPOT SLO.
Never: models queueing; these are single-request times on one replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from servelm.planner.chain import Chain, PlanResult
from servelm.planner.compute import (
    attention_flops_per_token,
    matmul_flops_per_token,
    prefill_attention_flops,
)
from servelm.planner.decode import step_time
from servelm.planner.deployment import Deployment
from servelm.planner.errors import (
    require_fraction,
    require_non_negative,
    require_positive,
)
from servelm.planner.units import fmt_num as f


class PrefillTime(NamedTuple):
    linear_flops: float
    attention_flops: float
    effective_flops: float  # FLOP/s the replica sustains: tp x peak x mfu
    weight_read_s: float
    time_no_attention_s: float
    time_s: float


def effective_flops(d: Deployment, mfu: float) -> float:
    return d.tp * d.peak_flops * mfu


def prefill_time(d: Deployment, num_tokens: float, mfu: float) -> PrefillTime:
    """Compute time of a lone prompt, never below one pass over the weights (a short
    prompt is memory-bound like a decode step)."""
    return batch_prefill_time(d, 1, num_tokens, mfu)


def batch_prefill_time(d: Deployment, num_seqs: int, prompt_len: float,
                       mfu: float) -> PrefillTime:
    """`num_seqs` prompts of `prompt_len` tokens prefilled together: their matmul FLOPs
    add up, each attends only to itself (num_seqs x the causal pairs of one prompt), and
    the weights are read at least once."""
    lin = num_seqs * prompt_len * matmul_flops_per_token(d.model)
    att = num_seqs * prefill_attention_flops(d.model, prompt_len)
    eff = effective_flops(d, mfu)
    w_s = d.weight_bytes_per_gpu / (d.gpu.hbm_bandwidth_Bps * d.calibration.bandwidth_fraction)
    return PrefillTime(lin, att, eff, w_s, max(lin / eff, w_s), max((lin + att) / eff, w_s))


def tokens_within(d: Deployment, budget_s: float, mfu: float) -> int:
    """Largest n with (f n + A (n^2 + n)/2) / eff <= budget: the root of a quadratic."""
    fl = matmul_flops_per_token(d.model)
    a_coef = attention_flops_per_token(d.model, 1.0) / 2  # A/2, A = per query-key pair
    b_coef = fl + a_coef
    c_coef = budget_s * effective_flops(d, mfu)
    n = (-b_coef + math.sqrt(b_coef * b_coef + 4 * a_coef * c_coef)) / (2 * a_coef)
    return max(int(math.floor(n)), 0)


@dataclass(frozen=True)
class PrefillPlan(PlanResult):
    command = "prefill"
    prefill_time_s: float
    prefill_time_no_attention_s: float
    tokens_within_budget: int
    decode_stall_s: float
    max_chunk_tokens: int
    num_chunks: int
    chunked_ttft_s: float


def _time_steps(c: Chain, d: Deployment, n: int, mfu: float) -> PrefillTime:
    m, p = d.model, prefill_time(d, n, mfu)
    c.add("linear_flops", "tokens x 2 x active_matmul_params",
          f"{f(n)} x {f(matmul_flops_per_token(m))}", p.linear_flops, "FLOP")
    c.add("attention_flops", "2 x layers x heads x (qk_dim + v_dim) x tokens x (tokens + 1) / 2",
          f"2 x {m.num_layers} x {m.num_heads} x ({m.qk_head_dim} + {m.value_head_dim}) x "
          f"{f(n)} x {f(n + 1)} / 2", p.attention_flops, "FLOP")
    c.add("effective_flops", f"tp x peak_{d.compute_dtype} x mfu",
          f"{d.tp} x {f(d.peak_flops)} x {mfu}", p.effective_flops, "FLOP/s")
    c.add("prefill_time_no_attention_s", "max(linear_flops / effective_flops, weight_read_s)",
          f"max({f(p.linear_flops)} / {f(p.effective_flops)}, {f(p.weight_read_s)})",
          p.time_no_attention_s, "s")
    c.add("prefill_time_s", "max((linear_flops + attention_flops) / effective_flops, "
          "weight_read_s)", f"max(({f(p.linear_flops)} + {f(p.attention_flops)}) / "
          f"{f(p.effective_flops)}, {f(p.weight_read_s)})", p.time_s, "s")
    return p


class ChunkBudget(NamedTuple):
    decode_step_s: float
    max_chunk_tokens: int


def max_chunk(d: Deployment, batch: int, context: int, prompt_len: int, tpot_s: float,
              mfu: float) -> ChunkBudget:
    """Largest chunk c such that one mixed step (batch decodes + c prompt tokens) stays
    within the TPOT SLO. Worst case: the last chunk attends to the whole prompt."""
    dec = step_time(d, batch, context)
    per_chunk_tok = (matmul_flops_per_token(d.model)
                     + attention_flops_per_token(d.model, prompt_len))
    # Mixed steps are large GEMMs, so the decode tokens' FLOPs also run at prefill MFU.
    budget_s = tpot_s - d.calibration.step_overhead_s
    spare_s = budget_s - dec.flops / effective_flops(d, mfu)
    if dec.memory_s > budget_s or spare_s <= 0:
        return ChunkBudget(dec.step_s, 0)
    return ChunkBudget(dec.step_s, min(int(spare_s * effective_flops(d, mfu) / per_chunk_tok),
                                       prompt_len))


def _stall_and_chunk_steps(c: Chain, d: Deployment, n: int, p: PrefillTime, batch: int,
                           context: int, tpot_s: float, mfu: float) -> tuple[float, int]:
    cb = max_chunk(d, batch, context, n, tpot_s, mfu)
    c.add("decode_step_s", f"decode step lower bound for {batch} streams at context "
          f"{context} (see `plan decode`)", "", cb.decode_step_s, "s")
    stall = c.add("decode_stall_s", "prefill_time_s (every active stream waits for the step "
                  "that carries the whole prompt)", f"{f(p.time_s)}", p.time_s, "s")
    c.add("stalled_tpot_s", "decode_step_s + decode_stall_s",
          f"{f(cb.decode_step_s)} + {f(stall)}", cb.decode_step_s + stall, "s")
    per_tok = matmul_flops_per_token(d.model) + attention_flops_per_token(d.model, n)
    dec_flops = step_time(d, batch, context).flops
    c.add("max_chunk_tokens", "floor((tpot - overhead - decode_flops / effective_flops) x "
          "effective_flops / (2 x active_matmul_params + attention_flops(prompt_len)))",
          f"floor(({tpot_s} - {d.calibration.step_overhead_s} - {f(dec_flops)} / "
          f"{f(p.effective_flops)}) x {f(p.effective_flops)} / {f(per_tok)})",
          cb.max_chunk_tokens, "tokens")
    if cb.max_chunk_tokens == 0:
        c.note(f"the decode batch alone exceeds the TPOT SLO {tpot_s} s: no chunk fits; "
               "lower --batch or raise --tp.")
    return stall, cb.max_chunk_tokens


def plan_prefill(d: Deployment, tokens: int, *, mfu: float | None = None,
                 ttft_s: float = 1.0, batch: int = 32, context: int = 2048,
                 tpot_s: float = 0.05) -> PrefillPlan:
    require_positive("--tokens", tokens)
    require_positive("--ttft", ttft_s)
    require_positive("--tpot", tpot_s)
    require_positive("--batch", batch)
    require_non_negative("--context", context)
    mfu = d.calibration.prefill_mfu if mfu is None else mfu
    require_fraction("--mfu", mfu)
    c = Chain()
    p = _time_steps(c, d, tokens, mfu)
    within = c.add("tokens_within_budget", "largest n: (2 P n + A (n^2 + n) / 2) / "
                   "effective_flops <= ttft  ->  n = (-b + sqrt(b^2 + 4 a c)) / 2a",
                   f"a = A/2 = {f(attention_flops_per_token(d.model, 1) / 2)}, "
                   f"b = 2P + A/2, c = {ttft_s} x {f(p.effective_flops)}",
                   tokens_within(d, ttft_s, mfu), "tokens")
    stall, chunk = _stall_and_chunk_steps(c, d, tokens, p, batch, context, tpot_s, mfu)
    chunks = math.ceil(tokens / chunk) if chunk else 0
    chunked_ttft = math.inf
    if chunk:
        c.add("num_chunks", "ceil(tokens / max_chunk_tokens)", f"ceil({f(tokens)} / {chunk})",
              chunks, "steps")
        chunked_ttft = c.add("chunked_ttft_s", "num_chunks x tpot (one chunk per step)",
                             f"{chunks} x {tpot_s}", chunks * tpot_s, "s")
    c.note("weight_read_s floors a short prompt: it cannot finish faster than one pass over "
           f"the weights ({f(p.weight_read_s)} s).")
    return PrefillPlan(
        inputs={**d.inputs(), "tokens": tokens, "mfu": mfu, "ttft_s": ttft_s,
                "batch": batch, "context": context, "tpot_s": tpot_s},
        steps=tuple(c.steps), notes=tuple(c.notes),
        prefill_time_s=p.time_s, prefill_time_no_attention_s=p.time_no_attention_s,
        tokens_within_budget=int(within), decode_stall_s=stall, max_chunk_tokens=chunk,
        num_chunks=chunks, chunked_ttft_s=chunked_ttft,
    )
