"""`servelm plan coldstart`: where a new replica's seconds go before its first token.

Owns: the stage breakdown: weight read from the storage tier, host-to-GPU copy over the
GPUs' host links, runtime init, warm-up and CUDA-graph capture (the last three from
Calibration, assumptions until measured), summed sequentially and with read/copy overlapped.
Never: models download from a hub (servelm loads from local paths or a registry package).
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.planner.chain import Chain, PlanResult
from servelm.planner.deployment import Deployment
from servelm.planner.hardware import LINKS, TIERS, Tier
from servelm.planner.units import fmt_num as f


@dataclass(frozen=True)
class ColdStartPlan(PlanResult):
    command = "coldstart"
    table_key = "tiers"
    weight_bytes: float
    storage_read_s: float
    host_to_gpu_s: float
    runtime_init_s: float
    warmup_s: float
    graph_capture_s: float
    total_s: float
    total_overlapped_s: float


def _stage_times(d: Deployment, tier: Tier) -> tuple[float, float, float]:
    storage = d.storage_bandwidth(tier).Bps
    cal = d.calibration
    fixed = cal.runtime_init_s + cal.warmup_s + cal.graph_capture_s_per_size * cal.num_graph_sizes
    # each GPU copies its own weights (its shard, plus the attention copy under dp) in parallel
    return d.weight_bytes / storage, d.weight_bytes_per_gpu / d.host_link.Bps, fixed


def _tier_rows(d: Deployment) -> tuple[dict, ...]:
    rows = []
    for t in TIERS.values():
        read, copy, fixed = _stage_times(d, t)
        rows.append({"tier": t.name, "storage_read_s": round(read, 2),
                     "host_to_gpu_s": round(copy, 2), "total_s": round(read + copy + fixed, 2),
                     "total_overlapped_s": round(max(read, copy) + fixed, 2)})
    return tuple(rows)


def _source(label: str) -> str:
    if label in LINKS:
        return f"{label}: {LINKS[label].source}."
    return f"{label}: from --calibration or its flag."


def plan_coldstart(d: Deployment, tier: Tier) -> ColdStartPlan:
    c, cal = Chain(), d.calibration
    storage, host = d.storage_bandwidth(tier), d.host_link
    w = c.add("weight_bytes", "total_params x bytes_per_param",
              f"{f(d.weight_bytes / d.bytes_per_param)} x {f(d.bytes_per_param)}",
              d.weight_bytes, "B")
    read = c.add("storage_read_s", f"weight_bytes / {storage.label} bandwidth",
                 f"{f(w)} / {f(storage.Bps)}", w / storage.Bps, "s")
    if d.is_dp_attention:
        copy = c.add("host_to_gpu_s", f"weight_bytes_per_gpu / {host.label} bandwidth (each "
                     "GPU copies its shard and its attention copy)",
                     f"{f(d.weight_bytes_per_gpu)} / {f(host.Bps)}",
                     d.weight_bytes_per_gpu / host.Bps, "s")
    else:
        copy = c.add("host_to_gpu_s", f"weight_bytes / (tp x {host.label} bandwidth)",
                     f"{f(w)} / ({d.tp} x {f(host.Bps)})", w / (d.tp * host.Bps), "s")
    init = c.add("runtime_init_s", "calibration.runtime_init_s", "", cal.runtime_init_s, "s")
    warm = c.add("warmup_s", "calibration.warmup_s", "", cal.warmup_s, "s")
    graphs = c.add("graph_capture_s", "num_graph_sizes x graph_capture_s_per_size",
                   f"{cal.num_graph_sizes} x {cal.graph_capture_s_per_size}",
                   cal.num_graph_sizes * cal.graph_capture_s_per_size, "s")
    total = c.add("total_s", "sum of the stages above",
                  f"{f(read)} + {f(copy)} + {f(init)} + {f(warm)} + {f(graphs)}",
                  read + copy + init + warm + graphs, "s")
    overlapped = c.add("total_overlapped_s", "max(storage_read_s, host_to_gpu_s) + the rest "
                       "(streamed loading)", f"max({f(read)}, {f(copy)}) + "
                       f"{f(init + warm + graphs)}", max(read, copy) + init + warm + graphs, "s")
    if cal.is_assumed:
        c.note("runtime init, warm-up and graph capture are assumptions; measure them and "
               "pass --calibration.")
    c.note(f"{_source(storage.label)} {_source(host.label)}")
    return ColdStartPlan(
        inputs={**d.inputs(), "tier": tier.name}, steps=tuple(c.steps), notes=tuple(c.notes),
        table=_tier_rows(d), weight_bytes=w, storage_read_s=read, host_to_gpu_s=copy,
        runtime_init_s=init, warmup_s=warm, graph_capture_s=graphs, total_s=total,
        total_overlapped_s=overlapped,
    )
