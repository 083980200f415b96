"""`servelm plan offload`: reload a cached prefix from a slower tier, or recompute it?

Owns: reload time (prefix KV bytes over the tier's effective bandwidth), the marginal
recompute time (its prefill FLOPs at an MFU; in a busy engine the weight reads are shared
with the batch, so only FLOPs count), the tier bandwidth at which the two are equal, and the
prompt length per tier above which reloading wins.
Never: models tier capacity or eviction policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from servelm.planner.chain import Chain, PlanResult
from servelm.planner.compute import attention_flops_per_token, matmul_flops_per_token
from servelm.planner.deployment import Deployment
from servelm.planner.errors import require_fraction, require_positive
from servelm.planner.hardware import TIERS, Tier
from servelm.planner.prefill import effective_flops, prefill_time
from servelm.planner.units import fmt_num as f


def recompute_time(d: Deployment, tokens: int, mfu: float) -> float:
    p = prefill_time(d, tokens, mfu)
    return (p.linear_flops + p.attention_flops) / p.effective_flops


def crossover_tokens(d: Deployment, bandwidth: float, mfu: float) -> float:
    """Prompt length above which reload beats recompute. Reload costs r = kv/bw per token;
    recompute costs (2P + A (n+1)/2) / eff per token, which grows with n. So reload wins for
    n > 2 (r eff - 2P) / A - 1, and for every n when r eff <= 2P."""
    r_eff = d.kv_bytes_per_token / bandwidth * effective_flops(d, mfu)
    two_p = matmul_flops_per_token(d.model)
    a = attention_flops_per_token(d.model, 1.0)
    return max(math.ceil(2 * (r_eff - two_p) / a - 1), 0)


@dataclass(frozen=True)
class OffloadPlan(PlanResult):
    command = "offload"
    table_key = "tiers"
    tier_bandwidth_Bps: float
    reload_time_s: float
    recompute_time_s: float
    crossover_bandwidth_Bps: float
    crossover_tokens: int
    reload_wins: bool


def _tier_rows(d: Deployment, tokens: int, mfu: float) -> tuple[dict, ...]:
    rows = []
    for t in TIERS.values():
        bw, _ = d.kv_tier_bandwidth(t)
        rows.append({"tier": t.name, "bandwidth_GBps": round(bw / 1e9, 2),
                     "reload_time_s": tokens * d.kv_bytes_per_token / bw,
                     "recompute_time_s": recompute_time(d, tokens, mfu),
                     "crossover_tokens": crossover_tokens(d, bw, mfu)})
    return tuple(rows)


def plan_offload(d: Deployment, tokens: int, tier: Tier, *,
                 mfu: float | None = None) -> OffloadPlan:
    require_positive("--tokens", tokens)
    mfu = d.calibration.prefill_mfu if mfu is None else mfu
    require_fraction("--mfu", mfu)
    c = Chain()
    nbytes = c.add("prefix_kv_bytes", "tokens x kv_bytes_per_token",
                   f"{f(tokens)} x {f(d.kv_bytes_per_token)}", tokens * d.kv_bytes_per_token, "B")
    bw, limit = d.kv_tier_bandwidth(tier)
    c.add("tier_bandwidth_Bps", "min(storage medium, kv_shard x GPU host link)", f"limited by {limit}",
          bw, "B/s")
    reload = c.add("reload_time_s", "prefix_kv_bytes / tier_bandwidth_Bps",
                   f"{f(nbytes)} / {f(bw)}", nbytes / bw, "s")
    p = prefill_time(d, tokens, mfu)
    rec = c.add("recompute_time_s", "(linear_flops + attention_flops) / (tp x peak x mfu)",
                f"({f(p.linear_flops)} + {f(p.attention_flops)}) / {f(p.effective_flops)}",
                recompute_time(d, tokens, mfu), "s")
    cross_bw = c.add("crossover_bandwidth_Bps", "prefix_kv_bytes / recompute_time_s",
                     f"{f(nbytes)} / {f(rec)}", nbytes / rec, "B/s")
    cross_n = c.add("crossover_tokens", "reload wins above n = max(ceil(2 (kv_bytes_per_token / "
                    "bw x eff_flops - 2P) / A - 1), 0), A = 2 layers heads (qk_dim + v_dim)",
                    f"2 x ({f(d.kv_bytes_per_token)} / {f(bw)} x {f(effective_flops(d, mfu))} - "
                    f"{f(matmul_flops_per_token(d.model))}) / "
                    f"{f(attention_flops_per_token(d.model, 1.0))} - 1",
                    crossover_tokens(d, bw, mfu), "tokens")
    c.note(f"reload {'wins' if reload < rec else 'loses'} at {f(tokens)} tokens from "
           f"{tier.name} ({tier.description}); a tier faster than crossover_bandwidth_Bps "
           "always wins at this length.")
    return OffloadPlan(
        inputs={**d.inputs(), "tokens": tokens, "tier": tier.name, "mfu": mfu},
        steps=tuple(c.steps), notes=tuple(c.notes), table=_tier_rows(d, tokens, mfu),
        tier_bandwidth_Bps=bw, reload_time_s=reload, recompute_time_s=rec,
        crossover_bandwidth_Bps=cross_bw, crossover_tokens=int(cross_n), reload_wins=reload < rec,
    )
