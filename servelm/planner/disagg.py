"""`servelm plan disagg`: prefill/decode disaggregation's network bill.

Owns: KV bytes shipped per request (the prompt's cache), transfer time over a link, and the
break-even bandwidth: the link speed at which shipping a prompt's KV takes as long as
computing it. Above it, transfer overlaps layer by layer with prefill and the prefill pool
never waits on the network; below it the link, not the GPUs, caps prefill throughput.
Never: models the decode-side benefit beyond the stall it avoids (see `plan prefill`).
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.planner.chain import Chain, PlanResult
from servelm.planner.deployment import Deployment
from servelm.planner.errors import require_fraction, require_positive
from servelm.planner.hardware import Link
from servelm.planner.prefill import prefill_time
from servelm.planner.units import fmt_num as f


@dataclass(frozen=True)
class DisaggPlan(PlanResult):
    command = "disagg"
    kv_transfer_bytes: float
    link_bandwidth_Bps: float
    transfer_time_s: float
    prefill_time_s: float
    break_even_bandwidth_Bps: float
    transfer_over_prefill: float


def plan_disagg(d: Deployment, input_len: int, link: Link, *,
                mfu: float | None = None) -> DisaggPlan:
    require_positive("--input-len", input_len)
    mfu = d.calibration.prefill_mfu if mfu is None else mfu
    require_fraction("--mfu", mfu)
    c = Chain()
    nbytes = c.add("kv_transfer_bytes", "input_len x kv_bytes_per_token",
                   f"{f(input_len)} x {f(d.kv_bytes_per_token)}",
                   input_len * d.kv_bytes_per_token, "B")
    # Each TP rank ships its own KV shard over its own link, in parallel; MLA's latent is
    # replicated on every rank, so one copy crosses one link.
    one = d.link_bandwidth(link)
    bw = c.add("link_bandwidth_Bps", f"{one.label} one-way bandwidth x kv_shard",
               f"{f(one.Bps)} x {f(d.kv_shard)}", one.Bps * d.kv_shard, "B/s")
    t = c.add("transfer_time_s", "kv_transfer_bytes / link_bandwidth_Bps",
              f"{f(nbytes)} / {f(bw)}", nbytes / bw, "s")
    p = prefill_time(d, input_len, mfu)
    pt = c.add("prefill_time_s", "max((linear + attention flops) / (tp x peak x mfu), "
               "weight_read_s) (see `plan prefill`)",
               f"max(({f(p.linear_flops)} + {f(p.attention_flops)}) / {f(p.effective_flops)}, "
               f"{f(p.weight_read_s)})", p.time_s, "s")
    be = c.add("break_even_bandwidth_Bps", "kv_transfer_bytes / prefill_time_s / kv_shard "
               "(per link)", f"{f(nbytes)} / {f(pt)} / {f(d.kv_shard)}",
               nbytes / pt / d.kv_shard, "B/s")
    ratio = c.add("transfer_over_prefill", "transfer_time_s / prefill_time_s",
                  f"{f(t)} / {f(pt)}", t / pt, "")
    verdict = ("hides behind prefill (pipeline per layer)" if ratio <= 1 else
               "is slower than prefill: the link caps the prefill pool")
    c.note(f"at {one.label} the transfer {verdict}; TTFT grows by at most transfer_time_s.")
    c.note(f"{link.name}: {link.source}." if one.label == link.name else
           f"{one.label}: {f(one.Bps)} B/s from --link-bw or calibration.kv_link_bandwidth_Bps.")
    return DisaggPlan(
        inputs={**d.inputs(), "input_len": input_len, "link": link.name, "mfu": mfu},
        steps=tuple(c.steps), notes=tuple(c.notes),
        kv_transfer_bytes=nbytes, link_bandwidth_Bps=bw, transfer_time_s=t,
        prefill_time_s=pt, break_even_bandwidth_Bps=be, transfer_over_prefill=ratio,
    )
