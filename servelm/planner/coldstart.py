"""`servelm plan coldstart`: where a new replica's seconds go before its first token.

Owns: the stage breakdown: weight read from the storage tier, host-to-GPU copy over the
GPUs' host links, runtime init, warm-up and CUDA-graph capture (the last three from
Calibration, assumptions until measured), summed sequentially and with read/copy overlapped.
Never: models download from a hub (servelm loads from local paths or a registry package).
"""

from __future__ import annotations

import dataclasses
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


# Each planned stage and the measured start-up stages (servelm/startup.py) it stands for.
MEASURED_STAGES: dict[str, tuple[str, ...]] = {
    "storage_read_s": ("weights_read", "weights_cache"),
    "host_to_gpu_s": (),  # inside weights_read on a GPU (the copy follows the read)
    "runtime_init_s": ("frontend_start", "interpreter", "imports", "config", "tokenizer",
                       "kernels", "kv_alloc", "engine_other", "core_spawn", "frontend_ready"),
    "warmup_s": ("warmup",),
    "graph_capture_s": ("graph_capture",),
}


@dataclass(frozen=True)
class ColdStartComparison(ColdStartPlan):
    """The plan with a measured start-up (`servelm bench coldstart` JSON) stage by stage."""

    table_key = "stages"
    measured_ready_s: float = 0.0
    measured_unplanned_s: float = 0.0


def measured_stages(record: dict, which: str = "warm_median") -> tuple[dict, float]:
    """(stages_s, ready_s) of a `servelm bench coldstart` record: its warm median or its cold
    run. Raises ValueError naming what is missing."""
    if record.get("kind") != "coldstart":
        raise ValueError("--measured: not a `servelm bench coldstart` record (kind "
                         f"{record.get('kind')!r})")
    part = record.get(which)
    if not part or "stages_s" not in part:
        raise ValueError(f"--measured: the record has no {which!r} stages")
    return dict(part["stages_s"]), float(part["ready_s"])


def compare_coldstart(plan: ColdStartPlan, stages: dict[str, float],
                      ready_s: float) -> ColdStartComparison:
    rows, covered = [], set()
    for planned, names in MEASURED_STAGES.items():
        got = [n for n in names if n in stages]
        covered.update(got)
        rows.append({"stage": planned, "planned_s": round(getattr(plan, planned), 3),
                     "measured_s": round(sum(stages[n] for n in got), 3) if got else "-",
                     "measured_as": " + ".join(got) if got else "-"})
    unplanned = {n: s for n, s in stages.items() if n not in covered}
    for name, seconds in unplanned.items():
        rows.append({"stage": name, "planned_s": "-", "measured_s": round(seconds, 3),
                     "measured_as": "not in the plan"})
    rows.append({"stage": "total_s", "planned_s": round(plan.total_s, 3),
                 "measured_s": round(ready_s, 3), "measured_as": "ready_s"})
    notes = plan.notes + (
        "measured: a `servelm bench coldstart` record (stages from the server's "
        "servelm_startup_stage_seconds, summing to its ready_s); '-' where this machine has "
        "no such stage (no GPU: no host-to-GPU copy, no CUDA graphs).",)
    if unplanned:
        notes += (f"measured but not planned: {', '.join(sorted(unplanned))} "
                  f"({sum(unplanned.values()):.2f} s).",)
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)
              if f.name not in ("table", "notes")}
    return ColdStartComparison(**{**fields, "notes": notes}, table=tuple(rows),
                               measured_ready_s=round(ready_s, 4),
                               measured_unplanned_s=round(sum(unplanned.values()), 4))
