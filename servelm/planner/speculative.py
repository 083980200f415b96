"""`servelm plan spec`: what speculative decoding buys at a batch size.

Owns: expected tokens per target step for acceptance rate a and draft length k,
E = (1 - a^(k+1)) / (1 - a) (Leviathan et al., 2023, eq. 1), the cost of a speculative step
(k draft steps + one target step scoring k+1 tokens per sequence), the speedup, and the
batch above which speculation stops paying.
Never: models acceptance as a function of position or temperature; a is one number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from servelm.planner.chain import Chain, PlanResult
from servelm.planner.decode import step_time
from servelm.planner.deployment import Deployment
from servelm.planner.errors import (
    PlanInputError,
    require_non_negative,
    require_positive,
)
from servelm.planner.units import fmt_num as f

_MAX_BATCH = 1 << 20


def expected_tokens_per_step(acceptance: float, draft_len: int) -> float:
    if acceptance == 1.0:
        return draft_len + 1.0
    return (1.0 - acceptance ** (draft_len + 1)) / (1.0 - acceptance)


class SpecStep(NamedTuple):
    plain_s: float  # target decode step, one token per sequence
    verify_s: float  # target step scoring k+1 tokens per sequence
    draft_s: float  # k draft steps
    speedup: float


def spec_step(d: Deployment, batch: int, context: int, acceptance: float, draft_len: int,
              draft_cost: float) -> SpecStep:
    """draft_cost: one draft-model step as a fraction of one plain target step at the same
    batch (~draft/target parameter ratio when both are memory-bound; 0 for n-gram)."""
    plain = step_time(d, batch, context).step_s
    verify = step_time(d, batch, context, tokens_per_seq=draft_len + 1).step_s
    draft = draft_len * draft_cost * plain
    e = expected_tokens_per_step(acceptance, draft_len)
    return SpecStep(plain, verify, draft, e * plain / (draft + verify))


def break_even_batch(d: Deployment, context: int, acceptance: float, draft_len: int,
                     draft_cost: float) -> float:
    """Largest batch at which speculation still pays (speedup >= 1); 0 if it never does.
    Speedup falls with batch once verification turns compute-bound, so bisection works."""
    def pays(b: int) -> bool:
        return spec_step(d, b, context, acceptance, draft_len, draft_cost).speedup >= 1.0

    if not pays(1):
        return 0.0
    if pays(_MAX_BATCH):
        return math.inf
    lo, hi = 1, 2
    while pays(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pays(mid) else (lo, mid)
    return float(lo)


def _weights_only_ridge(d: Deployment) -> float:
    """Ridge batch if KV reads were free: weight read time / compute time of one token."""
    one = step_time(d, 1, 0)
    return one.weight_bytes / (d.gpu.hbm_bandwidth_Bps * d.calibration.bandwidth_fraction) / (
        one.flops / (d.peak_flops * d.calibration.decode_mfu))


@dataclass(frozen=True)
class SpecPlan(PlanResult):
    command = "spec"
    expected_tokens_per_step: float
    speedup: float
    break_even_batch: float
    effective_tokens_per_s_per_user: float


def _step_costs(c: Chain, d: Deployment, batch: int, context: int, a: float, k: int,
                draft_cost: float) -> SpecStep:
    s = spec_step(d, batch, context, a, k, draft_cost)
    plain, verify = step_time(d, batch, context), step_time(d, batch, context, k + 1)
    oh = d.calibration.step_overhead_s
    plus = f" + {oh}" if oh else ""
    c.add("target_step_s", f"max(memory, compute) of a decode step at batch {batch}, "
          "1 token/seq (see `plan decode`)",
          f"max({f(plain.memory_s)}, {f(plain.compute_s)}){plus}", s.plain_s, "s")
    c.add("verify_step_s", f"same with k+1 = {k + 1} tokens/seq: weights and KV read once, "
          f"FLOPs x {k + 1}", f"max({f(verify.memory_s)}, {f(verify.compute_s)}){plus}",
          s.verify_s, "s")
    c.add("draft_time_s", "k x draft_cost x target_step_s",
          f"{k} x {draft_cost} x {f(s.plain_s)}", s.draft_s, "s")
    return s


def plan_spec(d: Deployment, acceptance: float, draft_len: int, *, batch: int = 1,
              context: int = 2048, draft_cost: float = 0.05) -> SpecPlan:
    if not 0 <= acceptance <= 1:
        raise PlanInputError("--acceptance", f"must be in [0, 1], got {acceptance}")
    require_positive("--draft-len", draft_len)
    require_positive("--batch", batch)
    require_positive("--context", context)
    require_non_negative("--draft-cost", draft_cost)
    if draft_cost >= 1:
        raise PlanInputError("--draft-cost", "must be < 1 (a fraction of a target step)")
    c = Chain()
    a, k = acceptance, draft_len
    e = c.add("expected_tokens_per_step", "(1 - a^(k+1)) / (1 - a)",
              f"(1 - {a}^{k + 1}) / (1 - {a})" if a < 1 else f"k + 1 = {k + 1}",
              expected_tokens_per_step(a, k), "tokens")
    s = _step_costs(c, d, batch, context, a, k, draft_cost)
    sp = c.add("speedup", "expected_tokens_per_step x target_step_s / (draft_time_s + "
               "verify_step_s)", f"{f(e)} x {f(s.plain_s)} / ({f(s.draft_s)} + {f(s.verify_s)})",
               s.speedup, "x")
    approx = _weights_only_ridge(d) * (e - k * draft_cost) / (k + 1)
    be = c.add("break_even_batch", "largest batch with speedup >= 1 (bisection)",
               "without KV reads it would be weights_only_ridge x (E - k x draft_cost) / "
               f"(k + 1) = {f(approx)}", break_even_batch(d, context, a, k, draft_cost),
               "sequences")
    c.add("effective_tokens_per_s_per_user", "expected_tokens_per_step / (draft_time_s + "
          "verify_step_s)", f"{f(e)} / {f(s.draft_s + s.verify_s)}",
          e / (s.draft_s + s.verify_s), "tok/s")
    if math.isinf(be):
        c.note("at this context plain decode stays memory-bound at any batch (KV reads), so "
               "verifying k+1 tokens per sequence costs less than E plain steps even at huge "
               "batch: speculation pays at every batch size (cf. MagicDec, Chen et al. 2024).")
    return SpecPlan(
        inputs={**d.inputs(), "acceptance": a, "draft_len": k, "draft_cost": draft_cost,
                "batch": batch, "context": context},
        steps=tuple(c.steps), notes=tuple(c.notes), expected_tokens_per_step=e,
        speedup=sp, break_even_batch=be,
        effective_tokens_per_s_per_user=e / (s.draft_s + s.verify_s),
    )
