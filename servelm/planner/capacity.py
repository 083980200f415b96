"""`servelm plan capacity`: concurrent users at a context length on N GPUs.

Owns: the memory budget per GPU (capacity x utilisation - activation reserve - weight
shard), the KV token pool, and users = pool / context, across TP x replicas.
Never: models time (decode.py); a user here holds a full context for its whole life.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from servelm.planner.chain import Chain, PlanResult
from servelm.planner.deployment import Deployment
from servelm.planner.errors import PlanInputError, require_positive
from servelm.planner.units import GB
from servelm.planner.units import fmt_num as f


@dataclass(frozen=True)
class CapacityPlan(PlanResult):
    command = "capacity"
    num_replicas: int
    weight_bytes_per_gpu: float
    kv_pool_bytes_per_gpu: float
    kv_tokens_per_replica: int
    kv_token_capacity: int
    users_per_replica: int
    max_concurrent_users: int


def _num_replicas(c: Chain, num_gpus: int, tp: int) -> int:
    if tp > num_gpus or num_gpus % tp:
        raise PlanInputError("--tp", f"{tp} must divide --num-gpus {num_gpus}")
    return int(c.add("num_replicas", "num_gpus / tp", f"{num_gpus} / {tp}", num_gpus // tp))


def _kv_pool_per_gpu(c: Chain, d: Deployment) -> tuple[float, float]:
    g = d.gpu
    usable = c.add("usable_bytes_per_gpu", "gpu_memory x mem_util - reserve",
                   f"{f(g.memory_bytes)} x {d.mem_util} - {f(d.reserve_gb * GB)}",
                   d.usable_bytes_per_gpu, "B")
    weights = c.add("weight_bytes_per_gpu", "total_params x bytes_per_param / tp",
                    f"{f(d.weight_bytes / d.bytes_per_param)} x {f(d.bytes_per_param)} / {d.tp}",
                    d.weight_bytes / d.tp, "B")
    pool = c.add("kv_pool_bytes_per_gpu", "usable_bytes_per_gpu - weight_bytes_per_gpu",
                 f"{f(usable)} - {f(weights)}", max(usable - weights, 0.0), "B")
    if usable <= weights:
        c.note("the weight shard does not fit: raise --tp, use a smaller --weight-dtype or "
               "a larger GPU.")
    return weights, pool


def _kv_per_token_per_gpu(c: Chain, d: Deployment) -> float:
    if d.model.is_mla:
        formula = "kv_bytes_per_token (MLA latent is replicated on every TP rank)"
        subst = f"{f(d.kv_bytes_per_token)}"
    else:
        formula = "kv_bytes_per_token / kv_shard, kv_shard = kv_heads / ceil(kv_heads / tp)"
        subst = f"{f(d.kv_bytes_per_token)} / {f(d.kv_shard)}"
    if not d.model.is_mla and d.tp > d.model.num_kv_heads:
        c.note(f"tp {d.tp} > {d.model.num_kv_heads} KV heads: ranks hold duplicate heads.")
    return c.add("kv_bytes_per_token_per_gpu", formula, subst,
                 d.kv_bytes_per_token / d.kv_shard, "B")


def plan_capacity(d: Deployment, num_gpus: int, context: int) -> CapacityPlan:
    require_positive("--num-gpus", num_gpus)
    require_positive("--context", context)
    c = Chain()
    replicas = _num_replicas(c, num_gpus, d.tp)
    weights, pool = _kv_pool_per_gpu(c, d)
    per_tok = _kv_per_token_per_gpu(c, d)
    tokens = int(c.add("kv_tokens_per_replica", "floor(kv_pool_bytes_per_gpu / "
                       "kv_bytes_per_token_per_gpu)", f"floor({f(pool)} / {f(per_tok)})",
                       math.floor(pool / per_tok), "tokens"))
    total = int(c.add("kv_token_capacity", "kv_tokens_per_replica x num_replicas",
                      f"{f(tokens)} x {replicas}", tokens * replicas, "tokens"))
    users = int(c.add("users_per_replica", "floor(kv_tokens_per_replica / context)",
                      f"floor({f(tokens)} / {f(context)})", tokens // context, "users"))
    max_users = int(c.add("max_concurrent_users", "users_per_replica x num_replicas",
                          f"{users} x {replicas}", users * replicas, "users"))
    c.note("a user holds a full context; with shorter average lengths and paged KV, more fit.")
    return CapacityPlan(
        inputs={**d.inputs(), "num_gpus": num_gpus, "context": context,
                "mem_util": d.mem_util, "reserve_gb": d.reserve_gb},
        steps=tuple(c.steps), notes=tuple(c.notes),
        num_replicas=replicas, weight_bytes_per_gpu=weights, kv_pool_bytes_per_gpu=pool,
        kv_tokens_per_replica=tokens, kv_token_capacity=total, users_per_replica=users,
        max_concurrent_users=max_users,
    )
