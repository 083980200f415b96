"""`servelm plan decode`: the step-time lower bound of a decode batch.

Owns: StepTime (memory time = weight + KV bytes over bandwidth; compute time = FLOPs over
peak; step = the larger + overhead), the ridge-point batch where compute overtakes memory,
and tokens/s per user and per GPU. spec.py and fleet.py reuse `step_time`.
Never: models TP all-reduce or kernel launch gaps beyond Calibration.step_overhead_s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from servelm.cost import (
    attention_pairs,
    count_params,
    expected_experts_touched,
    step_cost,
    weight_bytes_read_per_step,
)
from servelm.planner.chain import Chain, PlanResult
from servelm.planner.compute import attention_flops_per_token, matmul_flops_per_token
from servelm.planner.deployment import Deployment
from servelm.planner.errors import require_positive
from servelm.planner.units import fmt_num as f

_MAX_BATCH = 1 << 24


class StepTime(NamedTuple):
    weight_bytes: float  # read per step, whole replica
    kv_bytes: float
    flops: float
    memory_s: float
    compute_s: float
    step_s: float


def step_time(d: Deployment, batch: int, context: float, tokens_per_seq: int = 1) -> StepTime:
    """One forward step for `batch` sequences with `context` cached tokens each, scoring
    `tokens_per_seq` new tokens per sequence (k+1 when verifying drafts), costed by
    servelm.cost.step_cost: the KV cache is read once per sequence however many query tokens
    share it, and the new tokens' keys are written. Bytes are the replica's total over its
    tp GPUs: data-parallel attention reads tp copies of the attention weights, and each
    extra copy of a token's KV (tensor-parallel MLA: one per GPU) is read on its GPU."""
    cal = d.calibration
    num_tokens = batch * tokens_per_seq
    s = step_cost(d.model, d.bytes_per_param, d.kv_bytes_per_token, num_tokens,
                  batch * (context + tokens_per_seq),
                  batch * attention_pairs(context, tokens_per_seq))
    weight_bytes = s.weight_bytes + (d.attention_copies - 1) * d.attention_weight_bytes
    kv_bytes = s.kv_bytes * d.kv_copies
    mem_s = (weight_bytes + kv_bytes) / (d.tp * d.gpu.hbm_bandwidth_Bps * cal.bandwidth_fraction)
    comp_s = s.flops / (d.tp * d.peak_flops * cal.decode_mfu)
    return StepTime(weight_bytes, kv_bytes, s.flops, mem_s, comp_s,
                    max(mem_s, comp_s) + cal.step_overhead_s)


def ridge_batch(d: Deployment, context: float) -> float:
    """Smallest batch whose step is compute-bound; inf when KV reads grow as fast as FLOPs
    (long contexts), so the step never leaves the memory roof."""
    def is_compute_bound(b: int) -> bool:
        s = step_time(d, b, context)
        return s.compute_s >= s.memory_s

    if not is_compute_bound(_MAX_BATCH):
        return math.inf
    lo, hi = 0, 1
    while not is_compute_bound(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # bisection: MoE weight reads grow with batch, so no closed form
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if is_compute_bound(mid) else (mid, hi)
    return float(hi)


@dataclass(frozen=True)
class DecodePlan(PlanResult):
    command = "decode"
    memory_time_s: float
    compute_time_s: float
    step_time_s: float
    bound: str
    ridge_batch: float
    tokens_per_s_per_user: float
    tokens_per_s_per_gpu: float


def _memory_and_compute(c: Chain, d: Deployment, s: StepTime, batch: int, context: int) -> None:
    cal, g = d.calibration, d.gpu
    _weight_read_step(c, d, batch)
    copies = f" x {f(d.kv_copies)}" if d.kv_copies != 1 else ""
    c.add("kv_bytes_read", "batch x (context + 2) x kv_bytes_per_token (each sequence reads "
          "its context and new key, writes the new key)"
          + (" x kv_copies (one per GPU holding it)" if copies else ""),
          f"{batch} x ({f(context)} + 2) x {f(d.kv_bytes_per_token)}{copies}", s.kv_bytes, "B")
    c.add("memory_time_s", "(weight_bytes_read + kv_bytes_read) / (tp x hbm_bw x bw_fraction)",
          f"({f(s.weight_bytes)} + {f(s.kv_bytes)}) / ({d.tp} x {f(g.hbm_bandwidth_Bps)} x "
          f"{cal.bandwidth_fraction})", s.memory_s, "s")
    per_tok = s.flops / batch
    c.add("flops", "batch x (2 x active_matmul_params + attention_flops(context + 1 keys))",
          f"{batch} x {f(per_tok)}", s.flops, "FLOP")
    c.add("compute_time_s", f"flops / (tp x peak_{d.compute_dtype} x mfu)",
          f"{f(s.flops)} / ({d.tp} x {f(d.peak_flops)} x {cal.decode_mfu})", s.compute_s, "s")


def _weight_read_step(c: Chain, d: Deployment, batch: int) -> None:
    m, b = d.model, count_params(d.model)
    w = weight_bytes_read_per_step(m, batch, d.bytes_per_param)
    dp = d.attention_copies > 1
    extra = "" if not dp else " + (tp - 1) x attention_weight_bytes (each GPU reads its copy)"
    extra_n = "" if not dp else f" + {d.tp - 1} x {f(d.attention_weight_bytes)}"
    total = w + (d.attention_copies - 1) * d.attention_weight_bytes
    if not m.is_moe:
        c.add("weight_bytes_read", "active_matmul_params x bytes_per_param" + extra,
              f"{f(b.matmul_active)} x {f(d.bytes_per_param)}{extra_n}", total, "B")
        return
    touched = expected_experts_touched(m, batch)
    fixed = b.matmul_active - m.num_moe_layers * m.num_experts_per_tok * b.expert
    c.add("experts_touched_per_layer", "experts x (1 - (1 - experts_per_token/experts)^batch)",
          f"{m.num_experts} x (1 - (1 - {m.num_experts_per_tok}/{m.num_experts})^{batch})",
          touched, "experts")
    c.add("weight_bytes_read", "(non-expert matmul params + moe_layers x experts_touched x "
          "expert_params) x bytes_per_param" + extra,
          f"({f(fixed)} + {m.num_moe_layers} x {f(touched)} x {f(b.expert)}) x "
          f"{f(d.bytes_per_param)}{extra_n}", total, "B")


def _ridge_steps(c: Chain, d: Deployment, context: int) -> float:
    cal, g = d.calibration, d.gpu
    hw = c.add("hardware_ridge", "peak_flops x mfu / (hbm_bw x bw_fraction)",
               f"{f(d.peak_flops)} x {cal.decode_mfu} / ({f(g.hbm_bandwidth_Bps)} x "
               f"{cal.bandwidth_fraction})",
               d.peak_flops * cal.decode_mfu / (g.hbm_bandwidth_Bps * cal.bandwidth_fraction),
               "FLOP/B")
    per_tok = matmul_flops_per_token(d.model) + attention_flops_per_token(d.model, context + 1)
    seq = c.add("flops_per_kv_byte", "flops per sequence / its KV bytes",
                f"{f(per_tok)} / (({f(context)} + 2) x {f(d.kv_bytes_per_token)})",
                per_tok / ((context + 2) * d.kv_bytes_per_token), "FLOP/B")
    ridge = c.add("ridge_batch", "smallest batch with compute_time_s >= memory_time_s "
                  "(exists only if flops_per_kv_byte > hardware_ridge)",
                  "bisection over batch at this context", ridge_batch(d, context), "sequences")
    if math.isinf(ridge):
        c.note(f"ridge never reached: each added sequence brings {f(seq)} FLOP per KV byte, "
               f"below the GPU's {f(hw)} FLOP/B, so decode stays memory-bound at any batch.")
    return ridge


def plan_decode(d: Deployment, batch: int, context: int) -> DecodePlan:
    require_positive("--batch", batch)
    require_positive("--context", context)
    c = Chain()
    s = step_time(d, batch, context)
    _memory_and_compute(c, d, s, batch, context)
    bound = "memory" if s.memory_s >= s.compute_s else "compute"
    step = c.add("step_time_s", "max(memory_time_s, compute_time_s) + step_overhead_s",
                 f"max({f(s.memory_s)}, {f(s.compute_s)}) + {d.calibration.step_overhead_s}",
                 s.step_s, "s")
    ridge = _ridge_steps(c, d, context)
    per_user = c.add("tokens_per_s_per_user", "1 / step_time_s", f"1 / {f(step)}", 1 / step,
                     "tok/s")
    per_gpu = c.add("tokens_per_s_per_gpu", "batch / step_time_s / tp",
                    f"{batch} / {f(step)} / {d.tp}", batch / step / d.tp, "tok/s")
    c.note(f"{bound}-bound at batch {batch}. Lower bound at peak numbers unless calibrated; "
           "TP all-reduce time is not modelled.")
    return DecodePlan(
        inputs={**d.inputs(), "batch": batch, "context": context},
        steps=tuple(c.steps), notes=tuple(c.notes),
        memory_time_s=s.memory_s, compute_time_s=s.compute_s, step_time_s=step,
        bound=bound, ridge_batch=ridge, tokens_per_s_per_user=per_user,
        tokens_per_s_per_gpu=per_gpu,
    )
