"""`servelm plan fleet`: GPUs and replicas for a request rate, request shape and SLO pair.

Owns: per-replica sizing (decode batch = the smaller of KV room at full context and the
largest batch whose step meets TPOT; request cost = its prefill time plus its share of
decode steps), replicas = rate / (replica rate x max load), and, when --tp is not fixed,
the TP size that needs the fewest GPUs.
Never: simulates queues; `max_load` is the headroom that stands in for queueing delay.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from servelm.planner.chain import Chain, PlanResult
from servelm.planner.decode import step_time
from servelm.planner.deployment import Deployment
from servelm.planner.errors import require_fraction, require_positive
from servelm.planner.prefill import prefill_time
from servelm.planner.units import fmt_num as f


@dataclass(frozen=True)
class Workload:
    rps: float
    input_len: int
    output_len: int
    ttft_s: float = 1.0
    tpot_s: float = 0.05
    max_load: float = 0.8

    def __post_init__(self) -> None:
        require_positive("--rps", self.rps)
        require_positive("--input-len", self.input_len)
        require_positive("--output-len", self.output_len)
        require_positive("--ttft", self.ttft_s)
        require_positive("--tpot", self.tpot_s)
        require_fraction("--max-load", self.max_load)


class ReplicaSize(NamedTuple):
    kv_tokens: int
    kv_users: int
    tpot_batch: int
    decode_batch: int
    decode_step_s: float
    prefill_s: float
    replica_rps: float


def _tpot_batch(d: Deployment, context: float, tpot_s: float, cap: int) -> int:
    """Largest batch (<= cap) whose decode step meets TPOT; 0 if even batch 1 misses."""
    if cap <= 0 or step_time(d, 1, context).step_s > tpot_s:
        return 0
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if step_time(d, mid, context).step_s <= tpot_s else (lo, mid - 1)
    return lo


def size_replica(d: Deployment, w: Workload, mfu: float) -> ReplicaSize:
    full_ctx = w.input_len + w.output_len
    kv_tokens = d.kv_tokens_per_replica
    kv_users = d.sequences_per_replica(full_ctx)
    avg_ctx = w.input_len + w.output_len / 2  # a decoding request is half-way on average
    tpot_b = _tpot_batch(d, avg_ctx, w.tpot_s, kv_users)
    batch = min(kv_users, tpot_b)
    prefill_s = prefill_time(d, w.input_len, mfu).time_s
    if batch == 0:
        return ReplicaSize(kv_tokens, kv_users, tpot_b, 0, math.inf, prefill_s, 0.0)
    step_s = step_time(d, batch, avg_ctx).step_s
    rps = 1.0 / (prefill_s + w.output_len * step_s / batch)
    return ReplicaSize(kv_tokens, kv_users, tpot_b, batch, step_s, prefill_s, rps)


@dataclass(frozen=True)
class FleetPlan(PlanResult):
    command = "fleet"
    table_key = "tp_options"
    tp: int
    decode_batch: int
    replica_rps: float
    num_replicas: int
    num_gpus: int
    meets_ttft: bool


def _replicas(rs: ReplicaSize, w: Workload) -> int:
    return math.ceil(w.rps / (rs.replica_rps * w.max_load)) if rs.replica_rps else 0


def _candidates(d: Deployment, tp_fixed: bool) -> list[Deployment]:
    if tp_fixed:
        return [d]
    return [dataclasses.replace(d, tp=d.tp * k) for k in (1, 2, 4) if d.tp * k <= 64]


def _steps(c: Chain, d: Deployment, w: Workload, rs: ReplicaSize) -> None:
    full = w.input_len + w.output_len
    if d.is_dp_attention:  # a request cannot span GPUs: each GPU's pool on its own
        c.add("kv_users_per_replica", "tp x floor(kv_tokens_per_gpu / (input_len + "
              "output_len)) (see `plan capacity`)",
              f"{d.tp} x floor({f(d.kv_tokens_per_gpu)} / {full})", rs.kv_users, "users")
    else:
        c.add("kv_users_per_replica", "floor(kv_tokens_per_replica / (input_len + "
              "output_len)) (see `plan capacity`)", f"floor({f(rs.kv_tokens)} / {full})",
              rs.kv_users, "users")
    c.add("tpot_batch", f"largest batch with decode step <= tpot at context input_len + "
          f"output_len/2 = {f(w.input_len + w.output_len / 2)}", f"tpot {w.tpot_s} s",
          rs.tpot_batch, "sequences")
    c.add("decode_batch", "min(kv_users_per_replica, tpot_batch)",
          f"min({rs.kv_users}, {rs.tpot_batch})", rs.decode_batch, "sequences")
    c.add("decode_step_s", "decode step at decode_batch (see `plan decode`)", "",
          rs.decode_step_s, "s")
    c.add("prefill_time_s", "prefill of input_len tokens (see `plan prefill`)", "",
          rs.prefill_s, "s")
    c.add("replica_rps", "1 / (prefill_time_s + output_len x decode_step_s / decode_batch)",
          f"1 / ({f(rs.prefill_s)} + {w.output_len} x {f(rs.decode_step_s)} / "
          f"{rs.decode_batch})", rs.replica_rps, "req/s")
    n = c.add("num_replicas", "ceil(rps / (replica_rps x max_load))",
              f"ceil({w.rps} / ({f(rs.replica_rps)} x {w.max_load}))", _replicas(rs, w),
              "replicas")
    c.add("num_gpus", "num_replicas x tp", f"{f(n)} x {d.tp}", n * d.tp, "GPUs")


def plan_fleet(d: Deployment, w: Workload, *, tp_fixed: bool = False) -> FleetPlan:
    """Prefill runs at d.calibration.prefill_mfu, decode steps at its decode_mfu (the CLI's
    --prefill-mfu and --decode-mfu)."""
    mfu = d.calibration.prefill_mfu
    options = [(cd, size_replica(cd, w, mfu)) for cd in _candidates(d, tp_fixed)]
    table = tuple({"tp": cd.tp, "decode_batch": rs.decode_batch,
                   "replica_rps": round(rs.replica_rps, 3), "num_replicas": _replicas(rs, w),
                   "num_gpus": _replicas(rs, w) * cd.tp,
                   "meets_ttft": rs.prefill_s <= w.ttft_s} for cd, rs in options)
    feasible = [(cd, rs) for cd, rs in options if rs.decode_batch and rs.prefill_s <= w.ttft_s]
    pool = feasible or [(cd, rs) for cd, rs in options if rs.decode_batch] or options
    best, rs = min(pool, key=lambda o: (_replicas(o[1], w) * o[0].tp or math.inf, o[0].tp))
    c = Chain()
    _steps(c, best, w, rs)
    if not rs.decode_batch:
        c.note("no batch meets the TPOT SLO (or no KV room at this context): raise --tp, "
               "use a bigger GPU or relax --tpot.")
    if rs.prefill_s > w.ttft_s:
        c.note(f"prefill alone takes {f(rs.prefill_s)} s > TTFT SLO {w.ttft_s} s at tp "
               f"{best.tp}: the TTFT SLO cannot be met without more TP or disaggregation.")
    c.note("time-shared replica: prefills pause decodes; max_load leaves queueing headroom.")
    n = _replicas(rs, w)
    return FleetPlan(
        inputs={**best.inputs(), "rps": w.rps, "input_len": w.input_len,
                "output_len": w.output_len, "ttft_s": w.ttft_s, "tpot_s": w.tpot_s,
                "max_load": w.max_load, "prefill_mfu": mfu,
                "decode_mfu": best.calibration.decode_mfu},
        steps=tuple(c.steps), notes=tuple(c.notes), table=table if not tp_fixed else (),
        tp=best.tp, decode_batch=rs.decode_batch, replica_rps=rs.replica_rps,
        num_replicas=n, num_gpus=n * best.tp, meets_ttft=rs.prefill_s <= w.ttft_s,
    )
